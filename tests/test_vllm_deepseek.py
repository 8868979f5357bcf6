"""vLLM 0.32 ``sharded_state`` for DeepSeek-V3 (q LoRA: ``fused_qkv_a_proj``, sigmoid router with its fp32
selection bias, an MTP layer that vLLM's main model does not hold) and DeepSeek-V2-Lite-shaped models (no q LoRA:
``mla_attn.q_proj`` column-split and ``kv_a_proj_with_mqa`` whole), made by transformers itself: every rank file at
TP 1, 2, 4 and TP 2 with expert parallelism against the rules of tests/vllm_rules.py (written from
../shared/layouts/deepseek-v3.md section 8) and against section 8's key table, a chain through Megatron, torch_dist
and vLLM back to HF, load_rank, and the refusals.

The opt-in tests at the end (``-m vllm``, ``RESHARD_VLLM_PYTHON`` as tests/test_vllm_load.py) load reshard's output
in vLLM 0.32's CPU build: prompt logprobs against transformers' at TP 1 and 2 (``sharded_state`` and the
``load_format="reshard"`` plugin), and vLLM's own expected key set / shapes per rank at TP 2 with
``enable_expert_parallel`` (whose CPU MoE kernel cannot run a forward, deepseek-v3.md section 9.3)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

import reshard
from deepseek_checkpoints import V3_DIMS, add_mtp_layer, build_model, save_tiny
from helpers import run_cli
from test_vllm_load import no_inductor_cache_left, vllm_python  # noqa: F401 (the opt-in tests' fixtures)
from vllm_rules import expected_rank_mla, load_rank, vllm_expert_block

pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")

KINDS = ("v3", "v2")
L = V3_DIMS["num_hidden_layers"]
DEGREES = [(1, False), (2, False), (4, False), (2, True)]

# deepseek-v3.md section 8's per-layer key table (model.layers.{i}. omitted). vLLM 0.32 names V2-Lite's query
# projection self_attn.mla_attn.q_proj.weight, not section 8's self_attn.q_proj.weight: DeepseekV2MLAAttention and
# its mla_attn wrapper both register the module and _filter_subtensors keeps the smaller key (seen with vLLM's own
# dummy-loaded state dict, the vllm_keys.py probe, for a V2-Lite-shaped model at TP 1 and 2).
SECTION_8 = {
    "common": {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.kv_a_layernorm.weight",
               "self_attn.kv_b_proj.weight", "self_attn.mla_attn.o_proj.weight",
               "self_attn.mla_attn.mla_attn._k_scale", "self_attn.mla_attn.mla_attn._v_scale",
               "self_attn.mla_attn.mla_attn._q_scale", "self_attn.mla_attn.mla_attn._prob_scale"},
    "q_lora": {"self_attn.fused_qkv_a_proj.weight", "self_attn.mla_attn.q_a_layernorm.weight",
               "self_attn.mla_attn.q_b_proj.weight"},
    "no_q_lora": {"self_attn.mla_attn.q_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"},
    "dense": {"mlp.gate_up_proj.weight", "mlp.down_proj.weight"},
    "moe": {"mlp.experts.gate.weight", "mlp.experts.routed_experts.w13_weight",
            "mlp.experts.routed_experts.w2_weight", "mlp.experts._shared_experts._layer.gate_up_proj.weight",
            "mlp.experts._shared_experts._layer.down_proj.weight"},
    "noaux_tc": {"mlp.experts.gate.e_score_correction_bias"},
    "top": {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"},
}


def hf_state(folder) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "model.safetensors"))


def config_of(folder) -> dict:
    return json.load(open(os.path.join(folder, "config.json")))


def convert(capsys, src, dst, *args) -> str:
    code, _, err = run_cli(capsys, "convert", src, dst, *args)
    assert code == 0, err
    return err


def section_8_keys(config: dict) -> set[str]:
    """The keys one rank holds by section 8's table (every rank holds the same names)."""
    keys = set(SECTION_8["top"])
    for i in range(config["num_hidden_layers"]):
        layer = SECTION_8["common"] | SECTION_8["q_lora" if config.get("q_lora_rank") else "no_q_lora"]
        if i < config["first_k_dense_replace"]:
            layer |= SECTION_8["dense"]
        else:
            layer |= SECTION_8["moe"] | (SECTION_8["noaux_tc"] if config.get("topk_method") == "noaux_tc" else set())
        keys |= {f"model.layers.{i}.{k}" for k in layer}
    return keys


@pytest.fixture(scope="module")
def coded(tmp_path_factory):
    """Position-coded tiny V3 (with its MTP layer) and V2-Lite-shaped models."""
    root = tmp_path_factory.mktemp("deepseek-vllm")
    return {kind: save_tiny(str(root / kind), kind, fill="position") for kind in KINDS}


def check_ranks(folder, hf: dict, config: dict, tp: int, expert_parallel: bool, dtype=None) -> None:
    for r in range(tp):
        got, metas = load_rank(folder, r)
        want = expected_rank_mla(hf, config, tp, r, expert_parallel, dtype)
        assert set(got) == set(want) == section_8_keys(config), f"rank {r} names"
        for name, value in want.items():
            assert got[name].dtype == value.dtype and got[name].shape == value.shape, (
                f"rank {r} {name}: {got[name].dtype} {list(got[name].shape)}, want {value.dtype} {list(value.shape)}")
            assert torch.equal(got[name], value), f"rank {r} {name} bytes"
        assert all(m["tensor_parallel_size"] == str(tp) for m in metas)
        assert all((m.get("expert_parallel") == "true") == expert_parallel for m in metas)


@pytest.mark.parametrize("tp,expert_parallel", DEGREES, ids=[f"tp{t}" + ("-ep" if e else "") for t, e in DEGREES])
@pytest.mark.parametrize("kind", KINDS)
def test_rank_files_follow_the_mla_rules(coded, tmp_path, capsys, kind, tp, expert_parallel):
    """Every tensor of every rank equals the rule-built one, bit for bit, and the key set is section 8's; the
    config carries vLLM's routing keys and declares no MTP layer (V3's is dropped with a note)."""
    src, out = coded[kind], tmp_path / "vllm"
    err = convert(capsys, src, out, "--to", "vllm", "--tp", str(tp), *(["--expert-parallel"] if expert_parallel else []))
    config = config_of(out)
    assert ("dropped 1 MTP" in err) == (kind == "v3")
    check_ranks(out, hf_state(src), config, tp, expert_parallel)
    assert config["scoring_func"] == {"v3": "sigmoid", "v2": "softmax"}[kind]
    assert config["topk_method"] == {"v3": "noaux_tc", "v2": "greedy"}[kind]
    for key in ("n_group", "topk_group", "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob",
                "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        assert config[key] == config_of(src).get(key), key
    if kind == "v3":
        assert config["num_nextn_predict_layers"] == 0
    record = json.load(open(out / "reshard.json"))
    assert record["tensor_parallel_size"] == tp and record["expert_parallel"] == expert_parallel


def test_expert_blocks_follow_vllm_linear_placement():
    """vLLM's determine_expert_map, written out: 8 experts over 3 ranks are 3, 3, 2 in order."""
    assert [list(vllm_expert_block(8, 3, r)) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    from reshard.layouts.vllm import expert_block
    assert all(expert_block(e, t, r) == vllm_expert_block(e, t, r)
               for e in (2, 7, 8, 64) for t in (1, 2, 3, 4) if t <= e for r in range(t))


def test_bf16_keeps_the_router_bias_and_scales_fp32(coded, tmp_path, capsys):
    convert(capsys, coded["v3"], tmp_path / "v", "--to", "vllm", "--tp", "2", "--dtype", "bf16")
    check_ranks(tmp_path / "v", hf_state(coded["v3"]), config_of(tmp_path / "v"), 2, False, torch.bfloat16)


@pytest.mark.parametrize("kind", KINDS)
def test_megatron_torch_dist_vllm_chain_is_bit_exact(coded, tmp_path, capsys, kind):
    """hf -> megatron tp2 ep2 -> torch_dist -> megatron tp1 pp2 (local spec) -> hf -> vllm tp2 -> hf gives the
    source's bytes except V3's MTP layer, which the vLLM step drops with a note; ``reshard verify`` finds exactly
    that layer missing (and the MTP count 1 -> 0), everything else bit-identical."""
    src = coded[kind]
    convert(capsys, src, tmp_path / "m", "--to", "megatron", "--tp", "2", "--ep", "2")
    convert(capsys, tmp_path / "m", tmp_path / "d", "--to", "torch_dist", "--tp", "2", "--ep", "2")
    convert(capsys, tmp_path / "d", tmp_path / "l", "--to", "megatron", "--pp", "2", "--megatron-spec", "local")
    convert(capsys, tmp_path / "l", tmp_path / "h", "--to", "hf")
    err = convert(capsys, tmp_path / "h", tmp_path / "v", "--to", "vllm", "--tp", "2")
    assert ("dropped 1 MTP" in err) == (kind == "v3")
    check_ranks(tmp_path / "v", hf_state(src), config_of(tmp_path / "v"), 2, False)
    convert(capsys, tmp_path / "v", tmp_path / "back", "--to", "hf")
    a, b = hf_state(src), hf_state(tmp_path / "back")
    mtp = {k for k in a if k.startswith(f"model.layers.{L}.")} if kind == "v3" else set()
    assert len(mtp) == (42 + 2 if kind == "v3" else 0)  # the MoE layer, enorm / hnorm / eh_proj / norm, 2 copies
    assert sorted(b) == sorted(set(a) - mtp)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in b)
    for folder in (tmp_path / "v", tmp_path / "back"):
        report = reshard.verify(str(src), str(folder)).to_dict()
        statuses = {t["name"]: t["status"] for t in report["tensors"]}
        assert {n for n, s in statuses.items() if s != "equal"} == {n for n in mtp if n in statuses}
        assert all(statuses[n] == "missing_in_b" for n in mtp if n in statuses)
        assert report["config_differences"] == ([{"key": "mtp_layers", "a": 1, "b": 0}] if kind == "v3" else [])
        assert report["replica_differences"] == []
    code, out, _ = run_cli(capsys, "verify", src, tmp_path / "back")
    assert (code, "EQUAL" in out.splitlines()[-1]) == ((1, False) if kind == "v3" else (0, True)), out


@pytest.mark.parametrize("kind", KINDS)
def test_vllm_expert_parallel_folder_reads_into_other_layouts(coded, tmp_path, capsys, kind):
    """A vLLM tp2 expert-parallel folder and a tp4 one, read back: into HF directly and through Megatron tp2 ep2."""
    src = coded[kind]
    convert(capsys, src, tmp_path / "ep", "--to", "vllm", "--tp", "2", "--expert-parallel")
    convert(capsys, tmp_path / "ep", tmp_path / "m", "--to", "megatron", "--tp", "2", "--ep", "2")
    convert(capsys, tmp_path / "m", tmp_path / "v4", "--to", "vllm", "--tp", "4")
    check_ranks(tmp_path / "v4", hf_state(src), config_of(tmp_path / "v4"), 4, False)
    a = hf_state(src)
    for folder in ("ep", "v4"):
        convert(capsys, tmp_path / folder, tmp_path / f"h-{folder}", "--to", "hf")
        b = hf_state(tmp_path / f"h-{folder}")
        assert set(b) == {k for k in a if not k.startswith(f"model.layers.{L}.")}
        assert all(torch.equal(a[k], b[k]) for k in b), folder
        assert config_of(tmp_path / f"h-{folder}")["scoring_func"] == {"v3": "sigmoid", "v2": "softmax"}[kind]


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
@pytest.mark.parametrize("kind", KINDS)
def test_load_rank_equals_the_rank_files(coded, tmp_path, capsys, kind, expert_parallel):
    """reshard.load_rank(to="vllm", tp=2) from the HF source, and from a vLLM tp4 folder, gives each rank file's
    tensors exactly."""
    src = coded[kind]
    flag = ["--expert-parallel"] if expert_parallel else []
    convert(capsys, src, tmp_path / "v", "--to", "vllm", "--tp", "2", *flag)
    convert(capsys, src, tmp_path / "v4", "--to", "vllm", "--tp", "4")
    for source in (src, str(tmp_path / "v4")):
        for rank in range(2):
            got = reshard.load_rank(source, to="vllm", tp=2, rank=rank, expert_parallel=expert_parallel)
            files, _ = load_rank(tmp_path / "v", rank)
            assert sorted(got) == sorted(files)
            for name, tensor in files.items():
                assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), f"{source} {rank} {name}"


def refused(capsys, tmp_path, src, *args) -> str:
    out = tmp_path / "out"
    capsys.readouterr()  # what came before (transformers' save progress bar)
    code, stdout, err = run_cli(capsys, "convert", src, out, "--to", "vllm", *args)
    assert code == 2, stdout + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert not out.exists()
    return lines[0]


def test_impossible_degrees_are_refused_before_writing(coded, tmp_path, capsys):
    line = refused(capsys, tmp_path, coded["v3"], "--tp", "3")
    assert "num_attention_heads" in line and "tp=3" in line and "divides 4" in line
    line = refused(capsys, tmp_path, coded["v2"], "--tp", "2", "--pp", "2")
    assert "--pp must be 1" in line
    line = refused(capsys, tmp_path, coded["v2"], "--tp", "2", "--ep", "2")
    assert "--expert-parallel" in line


def test_expert_widths_that_do_not_split_are_refused(tmp_path, capsys):
    odd = save_tiny(str(tmp_path / "odd"), "v2", fill="position", moe_intermediate_size=6)
    line = refused(capsys, tmp_path, odd, "--tp", "4")
    assert "intermediate size 6" in line and "--expert-parallel" in line
    few = save_tiny(str(tmp_path / "few"), "v2", fill="position", n_routed_experts=2)
    line = refused(capsys, tmp_path, few, "--tp", "4", "--expert-parallel")
    assert "2 experts on 4 ranks" in line and "tp <= 2" in line


def test_a_vllm_folder_that_does_not_match_its_config_is_refused(coded, tmp_path, capsys):
    """A V3 vLLM folder whose config.json lost q_lora_rank reads as a model with mla_attn.q_proj, which it lacks."""
    convert(capsys, coded["v3"], tmp_path / "v", "--to", "vllm", "--tp", "2")
    config = config_of(tmp_path / "v")
    config["q_lora_rank"] = None
    json.dump(config, open(tmp_path / "v" / "config.json", "w"))
    code, stdout, err = run_cli(capsys, "convert", tmp_path / "v", tmp_path / "h", "--to", "hf")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "mla_attn.q_proj.weight" in lines[0], stdout + err
    assert not (tmp_path / "h").exists()


def test_plugin_names_the_routing_keys_a_transformers_v3_config_lacks(coded):
    """transformers' DeepseekV3Config writes neither scoring_func nor topk_method; vLLM then builds no router bias
    (deepseek-v3.md section 5), so load_format="reshard" names both keys instead of a bare missing parameter."""
    from reshard.vllm_plugin import _missing_config_keys

    missing = dict(_missing_config_keys(coded["v3"], {}))
    assert missing["scoring_func"] == "sigmoid" and missing["topk_method"] == "noaux_tc"
    assert "topk_method" not in dict(_missing_config_keys(coded["v2"], {}))  # DeepseekV2Config writes it


# ------------------------------------------------------------------------------------- vLLM itself (opt-in)

# vLLM's CPU MLA decode kernel needs kv_lora_rank + qk_rope_head_dim = 576 (deepseek-v3.md section 9.3); vocab
# 1000 pads to 1024 (tests/test_vllm_load.py's prompts use ids up to 999).
# YaRN RoPE with mscale as the probe ran it: with rope_type "default", vLLM 0.32 and transformers 5.24 disagree by
# 0.02-0.6 in prompt logprob even when vLLM loads the HF files themselves (load_format="auto"), so a check there
# could not tell a conversion mistake from that.
SERVED = dict(vocab_size=1000, hidden_size=256, intermediate_size=320, moe_intermediate_size=128, kv_lora_rank=512,
              qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, num_hidden_layers=3,
              max_position_embeddings=256,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                               "mscale": 0.707, "mscale_all_dim": 0.707})
SERVED_KINDS = {"v3": dict(SERVED, q_lora_rank=192), "v2": SERVED}

KEYS_WORKER = r'''
import json, os, sys
import torch, torch.multiprocessing as mp

def run(rank, folder, tp, port, out):
    torch.accelerator.empty_cache = lambda *a, **k: None  # the loader calls it; a CPU has no accelerator
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
    args = EngineArgs(model=folder, skip_tokenizer_init=True, dtype="float32", load_format="dummy",
                      tensor_parallel_size=tp, enable_expert_parallel=True, max_model_len=64, enforce_eager=True)
    config = args.create_engine_config()
    keys = {}
    original = DummyModelLoader.load_weights
    def load_weights(self, model, model_config):
        keys.update({k: [list(v.shape), str(v.dtype)] for k, v in
                     ShardedStateLoader._filter_subtensors(model.state_dict()).items()})
        return original(self, model, model_config)
    DummyModelLoader.load_weights = load_weights
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=tp, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=rank, backend="gloo")
        ensure_model_parallel_initialized(tp, 1)
        get_model_loader(config.load_config).load_model(vllm_config=config, model_config=config.model_config)
    json.dump(keys, open(f"{out}.rank{rank}.json", "w"))

if __name__ == "__main__":
    folder, tp, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    mp.spawn(run, args=(folder, tp, port, out), nprocs=tp, join=True)
'''


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Seeded fp32 V3 (with an MTP layer) and V2-Lite-shaped models vLLM's CPU build can run (matrices N(0, 0.05),
    noise 0.1 on every norm and the router bias, as tests/test_vllm_load.py), and transformers' model of each read
    back from the folder (it ignores the MTP layer)."""
    import transformers

    root = tmp_path_factory.mktemp("deepseek-served")
    out = {}
    for kind, dims in SERVED_KINDS.items():
        folder = str(root / kind)
        model = build_model(kind, **dims)
        torch.manual_seed(0)
        with torch.no_grad():
            for name, p in model.state_dict().items():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.1)
                else:
                    p.normal_(0.0, 0.05)
        model.save_pretrained(folder)
        if kind == "v3":
            add_mtp_layer(folder)
            # transformers' config class drops the routing keys the DeepSeek-V3 release's config.json spells out
            # and vLLM needs (without topk_method it builds no router bias): put them back as the release has them.
            config = config_of(folder)
            config.update(scoring_func="sigmoid", topk_method="noaux_tc")
            json.dump(config, open(os.path.join(folder, "config.json"), "w"), indent=2)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
        out[kind] = (folder, model)
    return out


@pytest.mark.vllm
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", sorted(SERVED_KINDS))
def test_vllm_serves_reshard_deepseek_output(tmp_path, vllm_python, served, kind, tp):
    """reshard's sharded_state output at TP 1 and 2, loaded by vLLM: prompt logprobs within 1e-4 of transformers'."""
    from test_vllm_load import compare, run_vllm

    folder, model = served[kind]
    out = tmp_path / f"vllm-tp{tp}"
    reshard.convert(folder, str(out), to="vllm", tp=tp)
    worst = compare(model, run_vllm(vllm_python, out, tp, tmp_path), f"{kind} tp={tp}")
    print(f"\ndeepseek {kind} tp={tp}: max |vLLM - transformers| prompt logprob = {worst:.3g}")


@pytest.mark.vllm
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", sorted(SERVED_KINDS))
def test_vllm_plugin_serves_a_deepseek_hf_folder(tmp_path, vllm_python, served, kind, tp):
    """``load_format="reshard"`` on the HF folder itself (V3 with its MTP layer, which load_rank drops)."""
    from test_vllm_load import compare, run_vllm

    folder, model = served[kind]
    worst = compare(model, run_vllm(vllm_python, folder, tp, tmp_path, load_format="reshard"),
                    f"{kind} load_format=reshard tp={tp}")
    print(f"\ndeepseek {kind} load_format=reshard tp={tp}: max |vLLM - transformers| prompt logprob = {worst:.3g}")


@pytest.mark.vllm
@pytest.mark.parametrize("kind", sorted(SERVED_KINDS))
def test_vllm_expects_the_expert_parallel_key_set(tmp_path, vllm_python, served, kind):
    """vLLM's own state dict at TP 2 with enable_expert_parallel (a dummy load: its CPU MoE kernel cannot run this
    forward), filtered as its sharded_state loader does, has exactly the names, shapes and dtypes of reshard's
    expert-parallel rank files."""
    folder, _ = served[kind]
    out = tmp_path / "vllm-ep"
    reshard.convert(folder, str(out), to="vllm", tp=2, expert_parallel=True)
    worker = tmp_path / "keys_worker.py"
    worker.write_text(KEYS_WORKER)
    from test_vllm_load import removing_inductor_caches, vllm_env

    # VLLM_DIST_IDENT: the CPU communicator's shared-memory name, set by vLLM's engine
    env = vllm_env(tmp_path, "keys", OMP_NUM_THREADS="1", VLLM_DIST_IDENT="reshard-keys")
    port = 29500 + os.getpid() % 1000

    with removing_inductor_caches():
        proc = subprocess.run([vllm_python, str(worker), str(out), "2", str(port), str(tmp_path / "keys")],
                              env=env, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for rank in range(2):
        want = json.load(open(tmp_path / f"keys.rank{rank}.json"))
        got, _ = load_rank(out, rank)
        assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
        for name, (shape, dtype) in want.items():
            assert [list(got[name].shape), str(got[name].dtype)] == [shape, dtype], name
