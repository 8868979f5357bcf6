"""Qwen3-Next's multi-token-prediction (MTP) head (mappings/qwen3_next.toml, reshard/layouts/qwen3_next_mtp.py;
../shared/layouts/families-2.md sections 4.1-4.3, 14.2 I; deepseek-v3.md section 4.2 for Megatron's MTP names).

The tiny model is tests/test_family_qwen3_next.py's (transformers' own Qwen3NextForCausalLM, 3 GDN layers + 1 gated
full-attention layer, MoE everywhere). transformers builds no MTP head, so the release's ``mtp.*`` tensors are
added to its file with position-coded values (``mtp.layers.0.*`` shaped as the full-attention layer 3, ``mtp.fc``
[H, 2H], ``mtp.pre_fc_norm_embedding`` / ``mtp.pre_fc_norm_hidden`` / ``mtp.norm`` [H]) and config.json declares
``num_nextn_predict_layers: 1`` (the key vLLM's Qwen3NextMTP reads).

- hf -> megatron tp2 ep2 -> torch_dist -> hf: every tensor, ``mtp.*`` included, bit-equal; the config keeps the key.
- Megatron ranks: ``mtp.layers.0.{enorm, hnorm, eh_proj, final_layernorm}`` and ``mtp.layers.0.transformer_layer.*``
  (megatron-core 0.16.1's MultiTokenPredictionLayer names), the attention tensors equal the probe's packing and TP
  slices (test_family_qwen3_next's probe_megatron / probe_slice), eh_proj the column slices of ``mtp.fc``, routed
  experts by EP rank; the args say ``mtp_num_layers = 1``.
- vLLM 0.32: the main model (Qwen3NextForCausalLM) holds no MTP (its MTP is the separate Qwen3NextMTP draft model,
  which reads ``mtp.*`` from the HF files): the vLLM output drops it with a note, its rank names are the main
  model's; vllm -> hf then gives the source less ``mtp.*``, bit-equal.
- megatron-core 0.16.1 (slow): the MTP block it builds for mtp_num_layers = 1 with this layer spec has exactly the
  rank names and shapes reshard writes.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_family_glm4_moe import config_of, hf_state, reshard_convert
from test_family_qwen3_next import H, probe_megatron, probe_slice, save_qwen3_next

L = 4  # the tiny model's decoder layers; its last (3) is full attention, as the MTP layer is
TP = 2


def position_coded(shape, seed: int) -> torch.Tensor:
    """Every element distinct and placed: its flat index, scaled, plus a per-tensor offset."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float32).reshape(shape) * 1e-4 + seed * 0.01).contiguous()


def add_mtp_head(folder) -> dict[str, torch.Tensor]:
    """Add the release's ``mtp.*`` tensors to the tiny model's file and ``num_nextn_predict_layers`` to config.json;
    returns the MTP tensors."""
    tensors = hf_state(folder)
    layer = {k.replace(f"model.layers.{L - 1}.", "mtp.layers.0."): v.shape for k, v in tensors.items()
             if k.startswith(f"model.layers.{L - 1}.")}
    shapes = {**layer, "mtp.fc.weight": (H, 2 * H), "mtp.pre_fc_norm_embedding.weight": (H,),
              "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.norm.weight": (H,)}
    mtp = {name: position_coded(shape, i + 1) for i, (name, shape) in enumerate(sorted(shapes.items()))}
    save_file({**tensors, **mtp}, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config = config_of(folder)
    config["num_nextn_predict_layers"] = 1
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return mtp


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    folder = save_qwen3_next(tmp_path_factory.mktemp("qwen3_next_mtp") / "hf")
    add_mtp_head(folder)
    return folder


@pytest.fixture(scope="module")
def chain(src, tmp_path_factory):
    """hf -> megatron tp2 ep2 -> torch_dist -> vllm tp2, and torch_dist -> hf; each step's stderr kept (vllm -> hf:
    the slow test)."""
    root = tmp_path_factory.mktemp("qwen3_next_mtp_chain")
    out = {k: str(root / k) for k in ("megatron", "torch_dist", "hf_td", "vllm", "hf_v")}
    err = {"megatron": reshard_convert(src, out["megatron"], "--to", "megatron", "--tp", "2", "--ep", "2"),
           "torch_dist": reshard_convert(out["megatron"], out["torch_dist"], "--to", "torch_dist", "--tp", "2",
                                         "--ep", "2"),
           "hf_td": reshard_convert(out["torch_dist"], out["hf_td"], "--to", "hf"),
           "vllm": reshard_convert(out["torch_dist"], out["vllm"], "--to", "vllm", "--tp", "2")}
    return out, err


def test_megatron_torch_dist_hf_carries_the_mtp_head_bit_exact(src, chain):
    out, err = chain
    source, back = hf_state(src), hf_state(out["hf_td"])
    assert sum(k.startswith("mtp.") for k in source) == 25 + 4  # layer 3's 25 + the head's 4
    assert sorted(back) == sorted(source)
    assert all(back[k].dtype == source[k].dtype and torch.equal(back[k], source[k]) for k in source)
    assert config_of(out["hf_td"])["num_nextn_predict_layers"] == 1
    assert not any("dropped" in e and "mtp" in e.lower() for k, e in err.items() if k != "vllm" and k != "hf_v")


def _rank(out, r: int) -> dict:
    return torch.load(os.path.join(out["megatron"], "release", f"mp_rank_0{r}_00{r}", "model_optim_rng.pt"),
                      weights_only=False)


def test_megatron_mtp_block_names_and_rank_tensors(src, chain):
    """TP rank r with EP rank r (tp2 ep2 on 2 GPUs: mp_rank_0r_00r): the MTP block as megatron-core spells it."""
    out, _ = chain
    hf = hf_state(src)
    as_layer = {k.replace("mtp.layers.0.", f"model.layers.{L}."): v for k, v in hf.items()}
    p = "mtp.layers.0."
    for r in range(TP):
        blob = _rank(out, r)
        model = blob["model"]
        mtp = {k for k in model if k.startswith("mtp.") and not k.endswith("_extra_state")}
        inner = {k.replace(p + "transformer_layer.", f"decoder.layers.{L - 1}.") for k in mtp
                 if k.startswith(p + "transformer_layer.")}
        decoder = {k for k in model if k.startswith(f"decoder.layers.{L - 1}.") and not k.endswith("_extra_state")}
        assert inner == decoder  # the MTP layer is the last (full-attention MoE) decoder layer's spec
        assert mtp - {p + "transformer_layer." + k.split(".", 3)[3] for k in decoder} == {
            p + "enorm.weight", p + "hnorm.weight", p + "eh_proj.weight", p + "final_layernorm.weight"}
        for name, full in probe_megatron(as_layer, L, "attn").items():
            key = name.replace(f"decoder.layers.{L}.", p + "transformer_layer.")
            assert torch.equal(model[key], probe_slice(key, full, TP, r)), (r, key)
        assert torch.equal(model[p + "eh_proj.weight"], hf["mtp.fc.weight"].chunk(TP, 0)[r])
        assert torch.equal(model[p + "enorm.weight"], hf["mtp.pre_fc_norm_embedding.weight"])
        assert torch.equal(model[p + "hnorm.weight"], hf["mtp.pre_fc_norm_hidden.weight"])
        assert torch.equal(model[p + "final_layernorm.weight"], hf["mtp.norm.weight"])
        for local in range(2):  # 4 experts, ep 2: experts 2r, 2r + 1 on this rank, fc1 = [gate; up] TP-sliced
            e, m = 2 * r + local, "mlp.experts.local_experts"
            gate, up = (hf[f"mtp.layers.0.mlp.experts.{e}.{x}_proj.weight"] for x in ("gate", "up"))
            fc1 = model[f"{p}transformer_layer.{m}.{local}.linear_fc1.weight"]
            assert torch.equal(fc1, torch.cat([gate.chunk(TP, 0)[r], up.chunk(TP, 0)[r]])), (r, e)
        assert vars(blob["args"])["mtp_num_layers"] == 1


def test_vllm_holds_the_main_model_and_says_why_mtp_is_dropped(chain):
    out, err = chain
    assert "dropped 1 MTP (multi-token prediction) layer(s) (the vllm layout holds the main model only)" in \
        err["vllm"], err["vllm"]
    for r in range(TP):
        names = load_file(os.path.join(out["vllm"], f"model-rank-{r}-part-0.safetensors"))
        assert len(names) == 64 and not any(k.startswith("mtp.") or "layers.4." in k for k in names)


@pytest.mark.slow
def test_vllm_back_to_hf_is_the_main_model_bit_exact(src, chain):
    out, _ = chain
    reshard_convert(out["vllm"], out["hf_v"], "--to", "hf")
    source = {k: v for k, v in hf_state(src).items() if not k.startswith("mtp.")}
    back = hf_state(out["hf_v"])
    assert sorted(back) == sorted(source)
    assert all(torch.equal(back[k], source[k]) for k in source)
    assert config_of(out["hf_v"])["num_nextn_predict_layers"] == 0


@pytest.mark.slow
def test_megatron_core_builds_this_mtp_block_and_loads_it_strictly(src, chain, tmp_path):
    """megatron-core 0.16.1 (tests/mcore_qwen3_next_mtp_harness.py: the Qwen3-Next CPU build plus its own
    get_gpt_mtp_block_spec for the args' mtp_num_layers) loads reshard's torch_dist strictly at tp2 ep2 etp1; each
    rank's mtp.* parameters have the names and shapes of reshard's Megatron rank files (the local spec's
    transformer_layer.input_layernorm is the TE spec's linear_qkv.layer_norm_weight) and their values; the experts,
    whole at etp1, are HF's [gate; up] and down of the rank's experts."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'reshard[test]')")
    from test_mcore_dist_fixtures import run_harness

    out, _ = chain
    torch.save(torch.tensor([[1, 2, 3]]), tmp_path / "ids.pt")
    harness = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcore_qwen3_next_mtp_harness.py")
    run_harness(harness, "load", "--ids", tmp_path / "ids.pt", "--tp", 2, "--ep", 2, "--etp", 1,
                out["torch_dist"], tmp_path / "mc.pt", timeout=300)
    hf, p = hf_state(src), "mtp.layers.0.transformer_layer."
    experts = f"{p}mlp.experts.local_experts."
    for r in range(TP):
        mc = torch.load(tmp_path / f"mc.pt.rank{r}", weights_only=True)
        mc = {k.replace(p + "input_layernorm.weight", p + "self_attention.linear_qkv.layer_norm_weight"): v
              for k, v in mc.items()}
        ours = {k: v for k, v in _rank(out, r)["model"].items()
                if k.startswith("mtp.") and isinstance(v, torch.Tensor)}
        assert sorted(mc) == sorted(ours) and len(mc) == 18
        for k in mc:
            if k.startswith(experts):
                local, fc = int(k[len(experts):].split(".")[0]), k.rsplit(".", 2)[1]
                e = f"mtp.layers.0.mlp.experts.{2 * r + local}."
                want = hf[e + "down_proj.weight"] if fc == "linear_fc2" else \
                    torch.cat([hf[e + "gate_proj.weight"], hf[e + "up_proj.weight"]])
                assert torch.equal(mc[k], want), (r, k)
            else:
                assert mc[k].shape == ours[k].shape and torch.equal(mc[k], ours[k]), (r, k)


def _with_config(src, folder, **changes) -> str:
    import shutil

    shutil.copytree(src, folder)
    config = {**config_of(folder), **changes}
    config = {k: v for k, v in config.items() if v is not None}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return str(folder)


def test_without_the_config_key_the_head_is_dropped_with_a_note_naming_it(src, tmp_path, capsys):
    from helpers import run_cli

    folder = _with_config(src, tmp_path / "nokey", num_nextn_predict_layers=None)
    code, out, err = run_cli(capsys, "convert", folder, tmp_path / "m", "--to", "megatron", "--tp", 2, "--dry-run")
    text = out + err
    assert code == 0 and "dropped 29 tensors under 'mtp.'" in text and "declares num_nextn_predict_layers" in text, \
        text


def test_two_mtp_layers_are_refused_in_one_line(src, tmp_path, capsys):
    """Qwen3-Next's head has one fc / norm set for all its MTP layers; Megatron's MTP layers each have their own."""
    from helpers import run_cli

    folder = _with_config(src, tmp_path / "two", num_nextn_predict_layers=2)
    code, _, err = run_cli(capsys, "convert", folder, tmp_path / "m", "--to", "megatron", "--tp", 2)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "num_nextn_predict_layers = 2" in err, err
    assert not os.path.exists(tmp_path / "m")


def test_load_rank_and_live_plan_carry_the_head(src):
    """load_rank to Megatron holds the MTP block (eh_proj = mtp.fc's rows); live.plan megatron tp2 ep2 -> megatron
    tp1 moves it, megatron -> vllm leaves it out with a note."""
    import reshard
    from reshard import live

    hf = hf_state(src)
    rank = reshard.load_rank(src, "megatron", tp=2, ep=2, rank=1, ep_rank=1)
    assert torch.equal(rank["mtp.layers.0.eh_proj.weight"], hf["mtp.fc.weight"][H // 2:])
    assert torch.equal(rank["mtp.layers.0.transformer_layer.mlp.experts.local_experts.1.linear_fc2.weight"],
                       hf["mtp.layers.0.mlp.experts.3.down_proj.weight"][:, 16:])
    plan = live.plan(src, source={"layout": "megatron", "tp": 2, "ep": 2}, target={"layout": "megatron", "tp": 1},
                     source_ranks=range(4), target_ranks=range(4, 5))
    names = {t.name for rank in plan.targets for t in rank}
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight"} <= names
    plan = live.plan(src, source={"layout": "megatron", "tp": 2, "ep": 2}, target={"layout": "vllm", "tp": 2},
                     source_ranks=range(4), target_ranks=range(4, 6))
    assert not any(t.name.startswith("mtp.") for rank in plan.targets for t in rank)
    assert any("left out 1 MTP" in n for n in plan.notes), plan.notes
