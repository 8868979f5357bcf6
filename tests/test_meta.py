"""Meta's consolidated format (``--to meta``): the files written independently from Meta's rules
(shared/layouts/dense-archs.md G: fairscale model-parallel splits, wq / wk rows in interleaved-RoPE order, the
inverse of transformers' ``convert_llama_weights_to_hf.permute``), the chains through it, the RoPE order proven
with transformers' logits, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import make_hf
from helpers import run_cli, tiny_transformers_model
from reshard.io.torch_format import TorchFile

transformers = pytest.importorskip("transformers")

VOCAB = 1004  # Meta's format does not pad: the vocab splits evenly over 2 and 4


def meta_from_hf(hf: dict[str, torch.Tensor], heads: int, kv_heads: int, n: int, rank: int) -> dict:
    """Meta's file ``rank`` of ``n``, written from transformers' tensors by Meta's own rules: the inverse of
    ``permute(w, n_heads, dim1, dim2) = w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2)`` on wq /
    wk, then fairscale's splits (ColumnParallel on dim 0, RowParallel on dim 1, VocabParallel on dim 0)."""
    def unpermute(w, n_heads):
        dim1, dim2 = w.shape
        return w.view(n_heads, 2, dim1 // n_heads // 2, dim2).transpose(1, 2).reshape(dim1, dim2)

    def col(w):
        return w.chunk(n, dim=0)[rank].clone()

    def row(w):
        return w.chunk(n, dim=1)[rank].clone()

    out = {"tok_embeddings.weight": col(hf["model.embed_tokens.weight"]), "norm.weight": hf["model.norm.weight"],
           "output.weight": col(hf["lm_head.weight"])}
    layers = {int(k.split(".")[2]) for k in hf if k.startswith("model.layers.")}
    for i in layers:
        p = f"model.layers.{i}."
        out.update({
            f"layers.{i}.attention.wq.weight": col(unpermute(hf[p + "self_attn.q_proj.weight"], heads)),
            f"layers.{i}.attention.wk.weight": col(unpermute(hf[p + "self_attn.k_proj.weight"], kv_heads)),
            f"layers.{i}.attention.wv.weight": col(hf[p + "self_attn.v_proj.weight"]),
            f"layers.{i}.attention.wo.weight": row(hf[p + "self_attn.o_proj.weight"]),
            f"layers.{i}.feed_forward.w1.weight": col(hf[p + "mlp.gate_proj.weight"]),
            f"layers.{i}.feed_forward.w3.weight": col(hf[p + "mlp.up_proj.weight"]),
            f"layers.{i}.feed_forward.w2.weight": row(hf[p + "mlp.down_proj.weight"]),
            f"layers.{i}.attention_norm.weight": hf[p + "input_layernorm.weight"],
            f"layers.{i}.ffn_norm.weight": hf[p + "post_attention_layernorm.weight"],
        })
    return out


def _read_all(path) -> dict[str, torch.Tensor]:
    f = TorchFile(str(path))
    try:
        return {name: f.read(name) for name in f.tensors}
    finally:
        f.close()


@pytest.fixture(scope="module")
def coded(tmp_path_factory):
    """A position-coded Llama (GQA 8 / 2 heads, untied)."""
    root = tmp_path_factory.mktemp("meta")
    return make_hf(str(root / "hf"), hidden=64, layers=2, heads=8, kv_heads=2, ffn=96, vocab=VOCAB)


@pytest.mark.parametrize("n", [1, 2])
def test_files_match_metas_rules(coded, capsys, tmp_path, n):
    assert run_cli(capsys, "convert", coded, tmp_path / "m", "--to", "meta", "--tp", str(n))[0] == 0
    hf = load_file(f"{coded}/model.safetensors")
    for rank in range(n):
        got = _read_all(tmp_path / f"m/consolidated.{rank:02d}.pth")
        want = meta_from_hf(hf, 8, 2, n, rank)
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            assert got[name].shape == tensor.shape and torch.equal(got[name], tensor), name
    params = json.loads((tmp_path / "m/params.json").read_text())
    assert {k: params[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")} == \
        {"dim": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2, "vocab_size": VOCAB}
    hidden = int(2 * 4 * 64 / 3)  # Meta's FFN rule must give the model's 96
    if params.get("ffn_dim_multiplier") is not None:
        hidden = int(params["ffn_dim_multiplier"] * hidden)
    assert params["multiple_of"] * -(-hidden // params["multiple_of"]) == 96


def test_chain_through_meta_and_vllm_is_bit_exact(coded, capsys, tmp_path):
    """hf -> meta tp2 -> vllm tp2 -> meta tp1 -> hf."""
    steps = [("m2", ["--to", "meta", "--tp", "2"]), ("v2", ["--to", "vllm", "--tp", "2"]), ("m1", ["--to", "meta"]),
             ("hf", ["--to", "hf"])]
    prev = coded
    for name, args in steps:
        code, _, err = run_cli(capsys, "convert", prev, tmp_path / name, *args)
        assert code == 0, err
        prev = tmp_path / name
    a, b = load_file(f"{coded}/model.safetensors"), load_file(str(tmp_path / "hf/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert run_cli(capsys, "verify", coded, tmp_path / "hf")[0] == 0
    assert run_cli(capsys, "verify", coded, tmp_path / "m2", "--forward")[0] == 0


def test_rope_order_is_proven_by_logits(capsys, tmp_path):
    """A Meta checkpoint (written by Meta's rules from a transformers model) converted to HF reproduces the model's
    logits; the same files with wq / wk left in transformers' order (the classic mistake) do not."""
    model = tiny_transformers_model(transformers, "LlamaConfig", num_key_value_heads=2, vocab_size=VOCAB,
                                    tie_word_embeddings=False)
    model.save_pretrained(tmp_path / "hf")
    hf = load_file(str(tmp_path / "hf/model.safetensors"))
    ids = torch.tensor([[1, 5, 900, 1003, 7, 3, 44, 2]])
    with torch.no_grad():
        want = model(ids).logits
    for name, rope_order in (("meta", True), ("wrong", False)):
        folder = tmp_path / name
        folder.mkdir()
        for rank in range(2):
            state = meta_from_hf(hf, 8, 2, 2, rank)
            if not rope_order:
                for i in range(2):
                    for w, src in (("wq", "q_proj"), ("wk", "k_proj")):
                        state[f"layers.{i}.attention.{w}.weight"] = \
                            hf[f"model.layers.{i}.self_attn.{src}.weight"].chunk(2, dim=0)[rank].clone()
            torch.save(state, folder / f"consolidated.{rank:02d}.pth")
        params = {"dim": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2, "vocab_size": VOCAB, "multiple_of": 32, "ffn_dim_multiplier": 96 / 170,
                  "norm_eps": model.config.rms_norm_eps, "rope_theta": model.config.rope_parameters["rope_theta"],
                  "max_seq_len": 128}
        (folder / "params.json").write_text(json.dumps(params))
        code, _, err = run_cli(capsys, "convert", folder, tmp_path / f"{name}-hf", "--to", "hf")
        assert code == 0, err
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-hf", dtype=torch.float32)
        with torch.no_grad():
            diff = (back(ids).logits - want).abs().max().item()
        assert (diff <= 1e-5) == rope_order, (name, diff)


def test_refusals(coded, capsys, tmp_path):
    """One line, exit 2, nothing written: a vocab that does not split, a family with biases (Qwen2), pp > 1, a tied
    model without --allow-lossy-config tied."""
    odd = make_hf(str(tmp_path / "odd"), hidden=64, layers=2, heads=8, kv_heads=2, ffn=96, vocab=1003)
    qwen2 = make_hf(str(tmp_path / "qwen2"), arch="Qwen2ForCausalLM", hidden=64, layers=2, heads=8, kv_heads=2,
                    ffn=96, vocab=VOCAB)
    tied = make_hf(str(tmp_path / "tied"), hidden=64, layers=2, heads=8, kv_heads=2, ffn=96, vocab=VOCAB, tied=True)
    for src, args, message in ((odd, ["--tp", "2"], "splits the vocab (1003)"),
                               (qwen2, [], "has no name for model.layers.{layer}.self_attn.q_proj.bias"),
                               (coded, ["--pp", "2"], "--pp must be 1"),
                               (tied, [], "cannot express tied")):
        out = tmp_path / "out"
        code, _, err = run_cli(capsys, "convert", src, out, "--to", "meta", *args)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
    code, _, err = run_cli(capsys, "convert", tied, tmp_path / "t", "--to", "meta", "--allow-lossy-config", "tied")
    assert code == 0, err
    got = _read_all(tmp_path / "t/consolidated.00.pth")
    assert torch.equal(got["output.weight"], got["tok_embeddings.weight"])
