"""The deepspeed layout against real DeepSpeed 0.19 checkpoints (trained two steps on CPU, bf16, world 2):
``--master-weights`` equals ``zero_to_fp32`` bit for bit (tied embedding, frozen norm, uneven padding); the default
output equals ``module`` (ZeRO-1/2, BF16_Optimizer) or the bf16 cast of the masters (ZeRO-3, universal); Qwen2-MoE's
fused experts; megatron tp2 / vllm tp2 logits; refusals. The full matrix (ZeRO 1/2/3 x world 1/2) is ``slow``."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from deepspeed_checkpoints import (bf16_optimizer_masters, bits_equal, fused, make_checkpoints, make_universal,
                                   module, oracle, tag_folder)
from helpers import run_cli
from test_hostile_inputs import _System  # a pickle that would run os.system("touch MARKER")
from reshard.api import convert

CASES = ["llama-2", "llama-3", "llama-bf16opt", "moe-3", "llama-2x"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("ds_scratch")
    roots = make_checkpoints(str(tmp_path_factory.mktemp("ds_w2")), 2, CASES, str(scratch))
    roots["universal-3"] = make_universal(roots["llama-3"], str(tmp_path_factory.mktemp("ds_universal")))
    return roots


def to_hf(src, dst, **kw) -> dict:
    convert(str(src), str(dst), to="hf", **kw)
    return load_file(os.path.join(dst, "model.safetensors"))


def check(out: dict, reference: dict, dtype=None):
    """``out`` (an HF output) equals ``reference`` (module names) bit for bit, cast to ``dtype`` first if given;
    a tied head is absent from the output."""
    out = fused(out)
    expected = {k for k in reference if k in out or k != "lm_head.weight"}
    assert set(out) == expected, sorted(set(out) ^ expected)
    bad = [k for k, v in out.items() if not bits_equal(v, reference[k] if dtype is None else reference[k].to(dtype))]
    assert not bad, bad


@pytest.mark.parametrize("case", ["llama-2", "llama-3", "moe-3"])
def test_master_weights_equal_zero_to_fp32(ckpts, tmp_path, case):
    out = to_hf(ckpts[case], tmp_path / "hf", master_weights=True)
    assert {v.dtype for v in out.values()} == {torch.float32}
    check(out, oracle(ckpts[case]), torch.float32)  # the oracle keeps the frozen norm bf16: upcast exactly


@pytest.mark.parametrize("case", ["llama-2", "llama-bf16opt"])
def test_default_output_is_the_module_bytes(ckpts, tmp_path, case):
    out = to_hf(ckpts[case], tmp_path / "hf")
    check(out, module(ckpts[case]))


@pytest.mark.parametrize("case", ["llama-3", "moe-3", "universal-3"])
def test_zero3_and_universal_default_is_the_bf16_cast_of_the_masters(ckpts, tmp_path, case):
    out = to_hf(ckpts[case], tmp_path / "hf")
    check(out, oracle(ckpts["llama-3" if case == "universal-3" else case]), torch.bfloat16)


def test_universal_master_weights_equal_zero_to_fp32(ckpts, tmp_path):
    check(to_hf(ckpts["universal-3"], tmp_path / "hf", master_weights=True), oracle(ckpts["llama-3"]), torch.float32)


def test_bf16_optimizer_masters_equal_an_independent_reading(ckpts, tmp_path):
    with pytest.raises(Exception, match="zero checkpoint"):
        oracle(ckpts["llama-bf16opt"])  # deepspeed's own reader refuses these files
    out = to_hf(ckpts["llama-bf16opt"], tmp_path / "hf", master_weights=True)
    masters = bf16_optimizer_masters(ckpts["llama-bf16opt"])
    frozen = {k: v.float() for k, v in module(ckpts["llama-bf16opt"]).items() if k not in masters}
    check(out, {**masters, **frozen}, torch.float32)
    assert set(frozen) == {"model.norm.weight", "lm_head.weight"}


@pytest.mark.parametrize("to", ["megatron", "vllm"])
def test_tp2_logits_equal_the_hf_output(ckpts, tmp_path, capsys, to):
    src = ckpts["moe-3"]
    hf = tmp_path / "hf"
    convert(src, str(hf), to="hf")
    code, _, err = run_cli(capsys, "convert", src, tmp_path / to, "--to", to, "--tp", "2")
    assert code == 0, err
    code, out, err = run_cli(capsys, "verify", hf, tmp_path / to, "--forward", "--nproc", "2")
    assert code == 0, (out, err)
    if to == "vllm":  # the DeepSpeed folder itself at TP 2 (its rank loader slices the canonical view)
        code, out, err = run_cli(capsys, "verify", tmp_path / to, src, "--forward", "--nproc", "2")
        assert code == 0 and "FORWARD EQUAL" in out, (out, err)


@pytest.mark.parametrize("case,tp,kw", [("llama-2", 1, {}), ("moe-3", 2, {}), ("moe-3", 2, {"master_weights": True})])
def test_load_rank_is_the_vllm_rank_file(ckpts, tmp_path, case, tp, kw):
    """``reshard.load_rank`` of a DeepSpeed folder (module bytes; ZeRO-3 partitions) holds what convert writes
    (the tiny Llama's 3 heads split over no tp but 1 and 3, its FFN of 50 not over 3)."""
    import reshard

    out = tmp_path / "vllm"
    convert(ckpts[case], str(out), to="vllm", tp=tp, **kw)
    for rank in range(tp):
        files = sorted(out.glob(f"model-rank-{rank}-part-*.safetensors"))
        written = {k: v for f in files for k, v in load_file(str(f)).items()}
        view = reshard.load_rank(ckpts[case], to="vllm", tp=tp, rank=rank, **kw)
        assert set(view) == set(written)
        assert all(bits_equal(view[k], written[k]) for k in written)


def test_inspect_says_what_was_read(ckpts, capsys):
    code, out, err = run_cli(capsys, "inspect", ckpts["llama-bf16opt"], "--json")
    assert code == 0, err
    assert "deepspeed" in out and "module" in out
    code, out, err = run_cli(capsys, "inspect", ckpts["llama-bf16opt"], "--master-weights", "--json")
    assert code == 0, err
    assert "BF16_Optimizer" in out and "fp32 masters" in out


def test_hf_trainer_checkpoint_prefers_its_hf_weights(ckpts, tmp_path):
    from safetensors.torch import save_file

    trainer = shutil.copytree(ckpts["llama-2"], tmp_path / "checkpoint-2")
    weights = {k: v.clone() for k, v in module(str(trainer)).items() if k != "lm_head.weight"}
    save_file(weights, str(trainer / "model.safetensors"), metadata={"format": "pt"})
    from reshard.layouts.base import Options
    from reshard.layouts.registry import open_checkpoint

    with open_checkpoint(str(trainer), Options()) as source:
        assert source.layout == "deepspeed"
        assert [os.path.basename(f.path) for f in source.files] == ["model.safetensors"]
        assert any("HF weights of the Trainer checkpoint" in n for n in source.info["notes"])
    with open_checkpoint(str(trainer), Options(master_weights=True)) as source:
        assert "fp32 masters" in source.info["deepspeed"]["weights_read"]


def test_tag_folder_and_tag_option(ckpts, tmp_path):
    root = shutil.copytree(ckpts["llama-2"], tmp_path / "root")
    reference = module(str(root))
    check(to_hf(tag_folder(str(root)), tmp_path / "a"), reference)  # the tag folder itself (config.json above)
    os.rename(root / "global_step2", root / "step_b")
    with pytest.raises(Exception, match="latest names global_step2, which does not exist; pass tag$"):
        to_hf(root, tmp_path / "b")
    check(to_hf(root, tmp_path / "c", tag="step_b"), reference)


def test_config_from_option_and_refused_without(ckpts, tmp_path):
    root = shutil.copytree(ckpts["llama-2"], tmp_path / "root")
    os.rename(root / "config.json", tmp_path / "model.json")
    with pytest.raises(Exception, match=r"config=FILE \(the model's Hugging Face config.json\)"):
        to_hf(root, tmp_path / "a")
    check(to_hf(root, tmp_path / "b", config=str(tmp_path / "model.json")), module(str(root)))


# ------------------------------------------------------------------------------------------------ refusals

def refused(capsys, src, *needles, extra=()):
    from tree_snapshot import snapshot

    before = snapshot(src)
    out = os.path.join(os.path.dirname(src), "out")
    code, _, err = run_cli(capsys, "convert", src, out, "--to", "hf", *extra)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert not os.path.exists(out)
    assert snapshot(src) == before
    return lines[0]


class _Unlisted:
    """A harmless class that is simply not on the allow-list."""


@pytest.mark.parametrize("evil", ["system", "unlisted"])
def test_hostile_optimizer_pickle_is_refused_and_never_runs(ckpts, tmp_path, capsys, evil):
    root = shutil.copytree(ckpts["llama-3"], tmp_path / "root")
    marker = tmp_path / "MARKER"
    path = os.path.join(tag_folder(str(root)), "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    state = torch.load(path, weights_only=False)
    state["optimizer_state_dict"]["evil"] = _System(marker) if evil == "system" else _Unlisted()
    torch.save(state, path)
    name = "posix.system" if evil == "system" else "test_deepspeed._Unlisted"
    refused(capsys, str(root), f"global '{name}'", "allow-list")
    assert not marker.exists()


def test_truncated_rank_file_is_refused(ckpts, tmp_path, capsys):
    root = shutil.copytree(ckpts["llama-3"], tmp_path / "root")
    path = os.path.join(tag_folder(str(root)), "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    os.truncate(path, os.path.getsize(path) // 2)
    refused(capsys, str(root), "bf16_zero_pp_rank_1")


@pytest.mark.parametrize("extra, needle", [
    ("layer_01-model_00-model_states.pt", "Megatron-DeepSpeed pipeline"),
    ("mp_rank_01_model_states.pt", "model-parallel rank 1"),
    ("expp_rank_0_mp_rank_00_optim_states.pt", "DeepSpeed-MoE"),
])
def test_unsupported_files_are_refused(ckpts, tmp_path, capsys, extra, needle):
    root = shutil.copytree(ckpts["llama-2"], tmp_path / "root")
    shutil.copy(os.path.join(tag_folder(str(root)), "mp_rank_00_model_states.pt"),
                os.path.join(tag_folder(str(root)), extra))
    refused(capsys, str(root), needle)


def test_missing_rank_file_is_refused(ckpts, tmp_path, capsys):
    root = shutil.copytree(ckpts["llama-3"], tmp_path / "root")
    os.remove(os.path.join(tag_folder(str(root)), "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    refused(capsys, str(root), "rank", "missing")


def test_param_shapes_inconsistent_with_partitions_are_refused(ckpts, tmp_path, capsys):
    root = shutil.copytree(ckpts["llama-2"], tmp_path / "root")
    path = os.path.join(tag_folder(str(root)), "mp_rank_00_model_states.pt")
    state = torch.load(path, weights_only=False)
    shapes = state["param_shapes"][0]
    first = next(iter(shapes))
    shapes[first] = torch.Size([shapes[first][0] + 8, shapes[first][1]])
    torch.save(state, path)
    refused(capsys, str(root), "param_shapes do not match", extra=("--master-weights",))


def test_excluded_frozen_parameters_are_refused(ckpts, tmp_path, capsys):
    refused(capsys, shutil.copytree(ckpts["llama-2x"], tmp_path / "root").as_posix(), "frozen parameters were "
            "excluded")


def test_lora_deltas_are_refused(ckpts, tmp_path, capsys):
    root = shutil.copytree(ckpts["llama-2"], tmp_path / "root")
    path = os.path.join(tag_folder(str(root)), "mp_rank_00_model_states.pt")
    state = torch.load(path, weights_only=False)
    state["module"] = {f"base_model.model.{k}": v for k, v in state["module"].items()}
    state["module"]["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"] = torch.zeros(2, 45)
    torch.save(state, path)
    refused(capsys, str(root), "merge the LoRA weights first")


def test_peft_prefix_is_stripped(ckpts, tmp_path):
    root = shutil.copytree(ckpts["llama-2"], tmp_path / "root")
    reference = module(str(root))
    path = os.path.join(tag_folder(str(root)), "mp_rank_00_model_states.pt")
    state = torch.load(path, weights_only=False)
    state["module"] = {f"base_model.model.{k}": v for k, v in state["module"].items()}
    state["shared_params"] = {f"base_model.model.{k}": f"base_model.model.{v}"
                              for k, v in state["shared_params"].items()}
    torch.save(state, path)
    check(to_hf(root, tmp_path / "hf"), reference)


def test_non_contiguous_view_is_refused(ckpts, tmp_path, capsys):
    root = shutil.copytree(ckpts["llama-2"], tmp_path / "root")
    path = os.path.join(tag_folder(str(root)), "mp_rank_00_model_states.pt")
    state = torch.load(path, weights_only=False)
    name = "model.layers.0.self_attn.o_proj.weight"
    state["module"][name] = state["module"][name].t().contiguous().t()
    torch.save(state, path)
    refused(capsys, str(root), "non-contiguous")


# ------------------------------------------------------------------------------------------------ full matrix

@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    scratch = str(tmp_path_factory.mktemp("ds_matrix_scratch"))
    cases = ["llama-1", "llama-2", "llama-3", "llama-bf16opt", "moe-1", "moe-2", "moe-3"]
    roots = {}
    for world in (1, 2):
        made = make_checkpoints(str(tmp_path_factory.mktemp(f"ds_matrix_w{world}")), world, cases, scratch)
        roots.update({f"w{world}-{c}": r for c, r in made.items()})
    for world in (1, 2):
        for stage in (2, 3):
            roots[f"w{world}-universal-{stage}"] = make_universal(
                roots[f"w{world}-llama-{stage}"], str(tmp_path_factory.mktemp(f"ds_u{world}{stage}")))
    return roots


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", ["llama-1", "llama-2", "llama-3", "llama-bf16opt", "moe-1", "moe-2", "moe-3",
                                  "universal-2", "universal-3"])
def test_matrix(matrix, tmp_path, capsys, world, case):
    src = matrix[f"w{world}-{case}"]
    origin = matrix[f"w{world}-llama-{case[-1]}"] if case.startswith("universal") else src
    masters = bf16_optimizer_masters(origin) if case.endswith("bf16opt") else oracle(origin)
    mod = module(origin) if not case.endswith("3") else None
    frozen = {k: v.float() for k, v in (mod or {}).items() if k not in masters}  # ZeRO-1: frozen from module
    check(to_hf(src, tmp_path / "master", master_weights=True), {**masters, **frozen}, torch.float32)
    default = to_hf(src, tmp_path / "default")
    if mod is not None and not case.startswith("universal"):
        check(default, mod)
    else:
        check(default, masters, torch.bfloat16)
    if case.startswith("moe"):
        for to in ("megatron", "vllm"):
            code, _, err = run_cli(capsys, "convert", src, tmp_path / to, "--to", to, "--tp", "2")
            assert code == 0, err
            code, out, err = run_cli(capsys, "verify", tmp_path / "default", tmp_path / to, "--forward",
                                     "--nproc", "2")
            assert code == 0, (out, err)


def test_a_universal_checkpoint_raises_the_open_file_limit():
    """One file per parameter: the soft limit on open files is raised for them (in a child, to keep ours)."""
    import subprocess
    import sys

    code = ("import resource; hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard)); "
            "from reshard.layouts.deepspeed_read import allow_open_files; allow_open_files(500); "
            "soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]; "
            "assert soft == (500 if hard == resource.RLIM_INFINITY or hard >= 500 else hard), soft")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_plan_lists_what_convert_writes(ckpts, tmp_path, capsys):
    """``reshard plan`` of a ZeRO-3 folder names the files and tensor bytes ``convert`` then writes."""
    import json

    code, out, err = run_cli(capsys, "plan", ckpts["moe-3"], "--to", "vllm", "--tp", "2", "--json")
    assert code == 0, err
    plan = json.loads(out)
    convert(ckpts["moe-3"], str(tmp_path / "vllm"), to="vllm", tp=2)
    written = sorted(p.name for p in (tmp_path / "vllm").glob("*.safetensors"))
    assert sorted(f["path"] for f in plan["files"]) == written
    tensors = [t for name in written for t in load_file(str(tmp_path / "vllm" / name)).values()]
    assert plan["bytes"] == sum(t.numel() * t.element_size() for t in tensors)
    read = plan["bytes_read_per_source"]  # ZeRO-3: every weight half on each rank's optimizer file
    optim = {k: v for k, v in read.items() if k.endswith("optim_states.pt")}
    assert len(optim) == 2 and all(v > 0.45 * sum(read.values()) for v in optim.values()), read
