"""DeepSeek-V3 (MLA, sigmoid router with a selection bias and group-limited top-k, shared experts, a dense first
layer, an MTP layer) and DeepSeek-V2-Lite-shaped (no q LoRA, softmax greedy routing) checkpoints made by transformers
itself, through HF, Megatron (TE and local spec) and torch_dist: bit-exact chains, the per-rank Megatron rules of
../shared/layouts/deepseek-v3.md section 4 written out here, MTP kept / dropped / absent, and the refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepseek_checkpoints import V3_DIMS, logits, save_tiny
from helpers import run_cli

pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")

KINDS = ("v3", "v2")
L = V3_DIMS["num_hidden_layers"]


def hf_state(folder) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "model.safetensors"))


def convert(capsys, src, dst, *args) -> str:
    code, _, err = run_cli(capsys, "convert", src, dst, *args)
    assert code == 0, err
    return err


def megatron_rank(folder, rank_dir: str) -> dict:
    return torch.load(os.path.join(folder, "release", rank_dir, "model_optim_rng.pt"), weights_only=False)


def edit_config(folder, **changes) -> None:
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        config.pop(key)
    json.dump(config, open(path, "w"))


@pytest.fixture(scope="module")
def coded(tmp_path_factory):
    """Position-coded tiny V3 (with its MTP layer) and V2-Lite-shaped models."""
    root = tmp_path_factory.mktemp("deepseek")
    return {kind: save_tiny(str(root / kind), kind, fill="position") for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_hf_megatron_torch_dist_local_spec_chain_is_bit_exact(coded, tmp_path, capsys, kind):
    """hf -> megatron tp2 ep2 -> torch_dist -> megatron tp1 pp2 (local spec) -> hf gives the source's bytes, MTP
    layer included; every config key of the routing survives."""
    src = coded[kind]
    convert(capsys, src, tmp_path / "m", "--to", "megatron", "--tp", "2", "--ep", "2")
    convert(capsys, tmp_path / "m", tmp_path / "d", "--to", "torch_dist", "--tp", "2", "--ep", "2")
    convert(capsys, tmp_path / "d", tmp_path / "l", "--to", "megatron", "--pp", "2", "--megatron-spec", "local")
    convert(capsys, tmp_path / "l", tmp_path / "h", "--to", "hf")
    a, b = hf_state(src), hf_state(tmp_path / "h")
    assert sorted(a) == sorted(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    if kind == "v3":
        assert f"model.layers.{L}.eh_proj.weight" in b and f"model.layers.{L}.mlp.experts.7.down_proj.weight" in b
    ca, cb = json.load(open(os.path.join(src, "config.json"))), json.load(open(tmp_path / "h" / "config.json"))
    for key in ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace",
                "num_experts_per_tok", "n_shared_experts", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                "qk_nope_head_dim", "v_head_dim", "num_nextn_predict_layers"):
        assert cb.get(key) == ca.get(key), key
    assert cb["scoring_func"] == ("sigmoid" if kind == "v3" else "softmax")
    assert cb["topk_method"] == ("noaux_tc" if kind == "v3" else "greedy")
    code, out, err = run_cli(capsys, "verify", src, tmp_path / "h")
    assert code == 0 and "EQUAL" in out, out + err


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_logits_of_a_megatron_round_trip(tmp_path, capsys, kind):
    src = save_tiny(str(tmp_path / "src"), kind, fill="random")
    convert(capsys, src, tmp_path / "m", "--to", "megatron", "--tp", "2", "--ep", "2", "--megatron-spec", "local")
    convert(capsys, tmp_path / "m", tmp_path / "h", "--to", "hf")
    torch.testing.assert_close(logits(str(tmp_path / "h")), logits(src), rtol=0, atol=1e-5)


def test_megatron_rank_files_follow_the_mla_rules(coded, tmp_path, capsys):
    """Spec section 4.1: TE keeps q_a_proj / kv_a_proj_with_mqa whole on every rank with the LoRA norms fused into
    the up projections; the local spec cuts them into plain row blocks and names the norms q_layernorm /
    kv_layernorm; q_b / kv_b by whole heads, o_proj by columns, the router bias fp32 under --dtype bf16, MTP on the
    last stage only (eh_proj split by rows)."""
    hf = hf_state(coded["v3"])
    nh, dq, dkv = V3_DIMS["num_attention_heads"], 12, 16
    convert(capsys, coded["v3"], tmp_path / "te", "--to", "megatron", "--tp", "2", "--pp", "2", "--dtype", "bf16")
    convert(capsys, coded["v3"], tmp_path / "lo", "--to", "megatron", "--tp", "2", "--megatron-spec", "local")
    bf = {k: v.to(torch.bfloat16) for k, v in hf.items()}
    for t in range(2):
        te = megatron_rank(tmp_path / "te", f"mp_rank_0{t}_000")["model"]
        last = megatron_rank(tmp_path / "te", f"mp_rank_0{t}_001")["model"]
        lo = megatron_rank(tmp_path / "lo", f"mp_rank_0{t}")["model"]
        p = "decoder.layers.1.self_attention."
        h = "model.layers.1.self_attn."
        assert torch.equal(te[p + "linear_q_down_proj.weight"], bf[h + "q_a_proj.weight"])
        assert torch.equal(te[p + "linear_kv_down_proj.weight"], bf[h + "kv_a_proj_with_mqa.weight"])
        assert torch.equal(te[p + "linear_q_up_proj.layer_norm_weight"], bf[h + "q_a_layernorm.weight"])
        assert torch.equal(te[p + "linear_kv_up_proj.layer_norm_weight"], bf[h + "kv_a_layernorm.weight"])
        heads = slice(t * nh // 2, (t + 1) * nh // 2)
        q_b = bf[h + "q_b_proj.weight"].reshape(nh, dq, -1)[heads].reshape(-1, 24)
        assert torch.equal(te[p + "linear_q_up_proj.weight"], q_b)
        kv_b = bf[h + "kv_b_proj.weight"].reshape(nh, dkv, -1)[heads].reshape(-1, 16)
        assert torch.equal(te[p + "linear_kv_up_proj.weight"], kv_b)
        assert torch.equal(te[p + "linear_proj.weight"], bf[h + "o_proj.weight"][:, t * 16:(t + 1) * 16])
        bias = te["decoder.layers.1.mlp.router.expert_bias"]
        assert bias.dtype == torch.float32 and torch.equal(bias, hf["model.layers.1.mlp.gate.e_score_correction_bias"])
        assert torch.equal(lo[p + "linear_q_down_proj.weight"], hf[h + "q_a_proj.weight"][t * 12:(t + 1) * 12])
        assert torch.equal(lo[p + "linear_kv_down_proj.weight"], hf[h + "kv_a_proj_with_mqa.weight"][t * 10:(t + 1) * 10])
        assert torch.equal(lo[p + "q_layernorm.weight"], hf[h + "q_a_layernorm.weight"])
        assert torch.equal(lo[p + "kv_layernorm.weight"], hf[h + "kv_a_layernorm.weight"])
        assert "decoder.layers.0.pre_mlp_layernorm.weight" in lo and "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te
        assert not any(k.startswith("mtp.") for k in te)
        m = f"model.layers.{L}."
        assert torch.equal(last["mtp.layers.0.eh_proj.weight"], bf[m + "eh_proj.weight"][t * 32:(t + 1) * 32])
        assert torch.equal(last["mtp.layers.0.enorm.weight"], bf[m + "enorm.weight"])
        assert torch.equal(last["mtp.layers.0.final_layernorm.weight"], bf[m + "shared_head.norm.weight"])
        assert torch.equal(last["mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.weight"],
                           bf[m + "self_attn.kv_b_proj.weight"].reshape(nh, dkv, -1)[heads].reshape(-1, 16))
        assert "mtp.layers.0.transformer_layer.pre_mlp_layernorm.weight" in last
    args = megatron_rank(tmp_path / "te", "mp_rank_00_001")["args"]
    assert (args.multi_latent_attention, args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim,
            args.qk_pos_emb_head_dim, args.v_head_dim) == (True, 24, 16, 8, 4, 8)
    assert (args.moe_router_score_function, args.moe_router_enable_expert_bias, args.moe_router_num_groups,
            args.moe_router_group_topk, args.moe_router_topk_scaling_factor) == ("sigmoid", True, 2, 2, 2.5)
    assert args.moe_layer_freq == [0, 1, 1, 1] and args.mtp_num_layers == 1
    assert args.moe_shared_expert_intermediate_size == 16 and args.mscale_all_dim == 0.0


def test_drop_mtp(coded, tmp_path, capsys):
    err = convert(capsys, coded["v3"], tmp_path / "h", "--to", "hf", "--drop-mtp")
    assert "dropped 1 MTP" in err
    assert not any(k.startswith(f"model.layers.{L}.") for k in hf_state(tmp_path / "h"))
    assert json.load(open(tmp_path / "h" / "config.json"))["num_nextn_predict_layers"] == 0
    convert(capsys, coded["v3"], tmp_path / "m", "--to", "megatron", "--drop-mtp")
    rank = megatron_rank(tmp_path / "m", "mp_rank_00")
    assert not any(k.startswith("mtp.") for k in rank["model"]) and rank["args"].mtp_num_layers is None
    code, out, _ = run_cli(capsys, "verify", tmp_path / "h", tmp_path / "m")
    assert code == 0, out


def test_declared_mtp_without_tensors_reads_as_none(tmp_path, capsys):
    """transformers' save_pretrained keeps num_nextn_predict_layers but writes no MTP tensor."""
    src = save_tiny(str(tmp_path / "src"), "v3", fill="position", mtp=False)
    edit_config(src, num_nextn_predict_layers=1)
    err = convert(capsys, src, tmp_path / "m", "--to", "megatron", "--tp", "2")
    assert "hold no tensor of them" in err
    assert megatron_rank(tmp_path / "m", "mp_rank_00")["args"].mtp_num_layers is None
    convert(capsys, tmp_path / "m", tmp_path / "h", "--to", "hf")
    assert json.load(open(tmp_path / "h" / "config.json"))["num_nextn_predict_layers"] == 0


def _refused(capsys, src, dst, *args, words: tuple[str, ...]) -> str:
    capsys.readouterr()  # what building the source printed
    code, _, err = run_cli(capsys, "convert", src, dst, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert all(w in err for w in words), err
    assert not os.path.exists(dst)
    return err


@pytest.mark.parametrize("missing", ["self_attn.kv_b_proj.weight", "embed_tokens.weight", "shared_head.head.weight"])
def test_a_partly_present_mtp_layer_is_refused(tmp_path, capsys, missing):
    src = save_tiny(str(tmp_path / "src"), "v3", fill="position")
    tensors = hf_state(src)
    del tensors[f"model.layers.{L}.{missing}"]
    save_file(tensors, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    _refused(capsys, src, tmp_path / "out", "--to", "hf", words=("MTP layer 4", missing, "partly present"))


def test_each_mtp_copy_is_checked_once(coded, tmp_path, capsys):
    convert(capsys, coded["v3"], tmp_path / "h", "--to", "hf")
    code, out, _ = run_cli(capsys, "verify", coded["v3"], tmp_path / "h")
    assert code == 0 and "4 stored replicas compared with the copy read: all identical" in out, out


def test_an_mtp_embedding_copy_that_differs_is_refused(tmp_path, capsys):
    src = save_tiny(str(tmp_path / "src"), "v3", fill="position")
    tensors = hf_state(src)
    tensors[f"model.layers.{L}.embed_tokens.weight"][3, 5] += 1
    save_file(tensors, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "megatron")
    assert code != 0 and "embed_tokens" in err, err
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("kind, change, words", [
    ("v3", dict(rope_interleave=False), ("rope_interleave",)),
    ("v3", dict(scoring_func="softmax"), ("scoring_func",)),
    ("v3", dict(topk_method="greedy"), ("topk_method",)),
    ("v3", dict(index_topk=2048), ("index_topk", "--allow-lossy-config")),
    ("v2", dict(norm_topk_prob=True), ("norm_topk_prob",)),
    ("v2", dict(topk_method="noaux_tc"), ("topk_method",)),
])
def test_configs_whose_meaning_reshard_cannot_carry_are_refused(coded, tmp_path, capsys, kind, change, words):
    src = tmp_path / "src"
    os.makedirs(src)
    for name in os.listdir(coded[kind]):
        os.symlink(os.path.join(coded[kind], name), src / name)
    os.unlink(src / "config.json")
    config = json.load(open(os.path.join(coded[kind], "config.json")))
    json.dump({**config, **change}, open(src / "config.json", "w"))
    _refused(capsys, src, tmp_path / "out", "--to", "megatron", words=words)


def test_local_spec_down_projections_must_split_evenly(tmp_path, capsys):
    """The local spec cuts q_a_proj into tp row blocks: 18 rows do not split over tp=4 (the TE spec, which keeps
    it whole, does)."""
    src = save_tiny(str(tmp_path / "src"), "v3", fill="position", mtp=False, q_lora_rank=18)
    _refused(capsys, src, tmp_path / "out", "--to", "megatron", "--tp", "4", "--megatron-spec", "local",
             words=("q_a_proj", "18 rows", "tp=4"))
    convert(capsys, src, tmp_path / "te", "--to", "megatron", "--tp", "4")


def test_newer_megatron_core_mtp_spelling_is_read(coded, tmp_path, capsys):
    """megatron-core after 0.16 names an MTP layer's decoder layer ``mtp_model_layer`` (spec section 4.2)."""
    convert(capsys, coded["v3"], tmp_path / "m", "--to", "megatron", "--tp", "2")
    for t in range(2):
        path = tmp_path / "m" / "release" / f"mp_rank_0{t}" / "model_optim_rng.pt"
        state = torch.load(path, weights_only=False)
        state["model"] = {k.replace(".transformer_layer.", ".mtp_model_layer."): v for k, v in state["model"].items()}
        torch.save(state, path)
    convert(capsys, tmp_path / "m", tmp_path / "h", "--to", "hf")
    a, b = hf_state(coded["v3"]), hf_state(tmp_path / "h")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_verify_drop_mtp_compares_the_main_models(coded, tmp_path, capsys):
    """A V3 conversion to vLLM holds no MTP layer: plain verify names the missing layer, --drop-mtp compares the
    main models (bit-exact here); the forward check refuses the option (it never runs MTP layers)."""
    convert(capsys, coded["v3"], tmp_path / "v", "--to", "vllm", "--tp", "2")
    code, out, _ = run_cli(capsys, "verify", coded["v3"], tmp_path / "v")
    assert code == 1 and "mtp_layers" in out, out
    code, out, err = run_cli(capsys, "verify", coded["v3"], tmp_path / "v", "--drop-mtp")
    assert code == 0 and "EQUAL" in out, out + err
    code, _, err = run_cli(capsys, "verify", coded["v3"], tmp_path / "v", "--drop-mtp", "--forward")
    assert code == 2 and "--drop-mtp applies to the digest check" in err, err
