"""Acceptance (issue 35): megatron-core's own ``LLaVAModel`` built on the CPU at TP 2 loads reshard's native-ViT
Megatron output of a LLaVA strictly (names and shapes; its forward needs CUDA, so no logits here).

``tests/mcore_llava_harness.py`` builds the model (2 gloo ranks, local spec) from the source's HF ``config.json``
and reports, per rank, the names the checkpoint lacks / has in excess, shape mismatches, the strict-load error and
replicated tensors that differ between ranks.  Before reshard is trusted:

* ``test_harness_selftest``: megatron-core's own ``state_dict()`` saved in Megatron-LM's torch layout (and its
  ``sharded_state_dict()`` through ``dist_checkpointing.save``) loads back clean, and each deliberate corruption
  (a renamed tensor, an unsplit one, a dropped ``_extra_state``, a replica that differs, one vision block too
  many) is reported as what it is;
* ``test_mcore_llava_names_match_spec``: what megatron-core builds for the tiny LLaVA at TP 2 is the key set and
  the per-rank shapes written out below from vlm.md section 3.4 / the research plan section 4.

Then reshard: ``reshard convert HF OUT --to megatron --tp 2 --megatron-spec local`` (the LLaVA default is the
native ViT layout) must load strictly on both ranks, and a few rank tensors must equal the ones built here from
the HF tensors by the layout rules of vlm.md section 4 (written from the spec, not from reshard): the CLIP
``linear_qkv`` as per-head ``[q_h; k_h; v_h]`` with rank r holding heads ``r*nv/t .. (r+1)*nv/t``, the class token
as ``[1, 1, Hv]``, column / row splits of the MLP and the projector, the replicated norms and embeddings, and the
language model's GQA ``linear_qkv`` and padded embedding.  ``--to torch_dist`` likewise through
``dist_checkpointing.load``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'reshard[test]')")
pytest.importorskip("transformers", reason="transformers is not installed")

sys.path.insert(0, str(Path(__file__).parent))
import vlm_cases  # noqa: E402
from test_mcore_dist_fixtures import run_harness  # noqa: E402  (own session, timeout, no process left behind)

HARNESS = Path(__file__).with_name("mcore_llava_harness.py")
TP = 2

# The tiny LLaVA (vlm_cases "llava"; plan section 7) and its Megatron sizes.
H, FFN, L, NH, NG, D, V = 64, 96, 2, 4, 2, 16, 300
# vision_feature_layer -2 uses CLIP blocks 0-1 of 3; Megatron-LM builds and converts every block (its CLIP ViT-L/14
# config has all 24 layers, examples/multimodal/config.py, and clip_converter.py writes them all), never ln_post
HV, FV, NV, LV, N_BUILT, PATCHES = 32, 48, 2, 3, 3, 4
VP = 512  # Megatron-LM pads 300 to a multiple of 128 * TP
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def spec_rank_state(tp: int = TP) -> dict[str, list[int] | None]:
    """The per-rank state dict names and shapes of megatron-core's LLaVAModel (local spec) for the tiny LLaVA at
    TP ``tp``, from vlm.md 3.4 / plan 4 (``None``: an ``_extra_state``)."""
    sd: dict[str, list[int] | None] = {"language_model.embedding.word_embeddings.weight": [VP // tp, H]}
    for layer in range(L):
        p = f"language_model.decoder.layers.{layer}."
        sd.update({p + "input_layernorm.weight": [H],
                   p + "self_attention.linear_qkv.weight": [(NH + 2 * NG) * D // tp, H],
                   p + "self_attention.linear_proj.weight": [H, NH * D // tp], p + "pre_mlp_layernorm.weight": [H],
                   p + "mlp.linear_fc1.weight": [2 * FFN // tp, H], p + "mlp.linear_fc2.weight": [H, FFN // tp]})
        sd.update({p + m + "._extra_state": None for m in LINEARS})
    sd.update({"language_model.decoder.final_layernorm.weight": [H],
               "language_model.output_layer.weight": [VP // tp, H], "language_model.output_layer._extra_state": None,
               "vision_model.class_token": [1, 1, HV], "vision_model.conv1.weight": [HV, 3, 14, 14],
               "vision_model.position_embeddings.weight": [PATCHES + 1, HV],
               "vision_model.ln_pre.weight": [HV], "vision_model.ln_pre.bias": [HV]})
    for b in range(N_BUILT):
        p = f"vision_model.decoder.layers.{b}."
        for norm in ("input_layernorm", "pre_mlp_layernorm"):
            sd.update({p + norm + ".weight": [HV], p + norm + ".bias": [HV]})
        sd.update({p + "self_attention.linear_qkv.weight": [3 * HV // tp, HV],
                   p + "self_attention.linear_qkv.bias": [3 * HV // tp],
                   p + "self_attention.linear_proj.weight": [HV, HV // tp], p + "self_attention.linear_proj.bias": [HV],
                   p + "mlp.linear_fc1.weight": [FV // tp, HV], p + "mlp.linear_fc1.bias": [FV // tp],
                   p + "mlp.linear_fc2.weight": [HV, FV // tp], p + "mlp.linear_fc2.bias": [HV]})
        sd.update({p + m + "._extra_state": None for m in LINEARS})
    p = "vision_projection.encoder."
    sd.update({p + "linear_fc1.weight": [H // tp, HV], p + "linear_fc1.bias": [H // tp],
               p + "linear_fc1._extra_state": None,
               p + "linear_fc2.weight": [H, H // tp], p + "linear_fc2.bias": [H], p + "linear_fc2._extra_state": None})
    return sd


def harness(*args, timeout: float = 240.0) -> subprocess.CompletedProcess:
    return run_harness(HARNESS, *args, "--tp", TP, timeout=timeout)


def rank_json(folder: Path, stem: str) -> list[dict]:
    return [json.loads((folder / f"{stem}_rank{r}.json").read_text()) for r in range(TP)]


def describe(result: dict) -> str:
    """A rank's harness result in a few lines, for an assertion message."""
    lines = [f"rank {result['rank']} ({result['format']}): ok={result['ok']}"]
    for field in ("missing", "unexpected", "shape_mismatch", "replica_mismatch"):
        if result[field]:
            lines.append(f"  {field} ({len(result[field])}): {json.dumps(result[field][:20])}")
    if result.get("unexpected_objects"):
        lines.append(f"  unexpected_objects (tolerated): {result['unexpected_objects'][:10]}")
    if result["load_error"]:
        lines.append(f"  load_error: {result['load_error'][:1500]}")
    return "\n".join(lines)


# ---- the harness itself ----

@pytest.fixture(scope="module")
def selftest(tmp_path_factory):
    out = tmp_path_factory.mktemp("llava_selftest")
    harness("selftest", out)
    return out


def test_harness_selftest(selftest):
    """Clean round trips load; every corruption is reported as what it is, on both ranks."""
    qkv = "vision_model.decoder.layers.0.self_attention.linear_qkv.weight"
    fc1 = "vision_projection.encoder.linear_fc1.weight"
    extra = "vision_model.decoder.layers.0.mlp.linear_fc2._extra_state"
    for result in rank_json(selftest, "selftest"):
        cases = result["cases"]
        clean = cases["clean"]
        assert clean["ok"] and clean["loaded_equal"], describe(clean)
        assert clean["weights_differed_before_load"] >= 20, clean  # a fresh seed: the load really replaced them
        assert clean["dims"]["vision_layers"] == N_BUILT and clean["padded_vocab"] == VP, clean["dims"]

        c = cases["renamed"]
        assert (c["missing"], c["unexpected"]) == ([qkv], [qkv + "s"]) and c["load_error"] and not c["ok"], describe(c)
        c = cases["reshaped"]
        assert c["shape_mismatch"] == [{"key": fc1, "model": [H // TP, HV], "checkpoint": [H, HV]}], describe(c)
        assert not c["missing"] and not c["unexpected"] and c["load_error"] and not c["ok"], describe(c)
        c = cases["dropped_extra_state"]  # megatron-core's own load forgives it (its LLaVA hook); the harness not
        assert c["missing"] == [extra] and c["load_error"] is None and not c["ok"], describe(c)
        c = cases["replica"]
        assert c["replica_mismatch"] == ["vision_model.class_token"] and not c["ok"], describe(c)
        c = cases["wrong_config"]  # a model of one vision block more than the file holds
        assert {k.split(".")[3] for k in c["missing"]} == {str(N_BUILT)} and len(c["missing"]) == 16, describe(c)
        assert not c["ok"]

        td = cases["torch_dist"]
        assert td["ok"] and td["loaded_equal"] and td["values_equal_saved"], describe(td)
        assert not td["unexpected_objects"], td["unexpected_objects"]
        c = cases["torch_dist_wrong_config"]  # the stacked layer axis: one block more wanted than stored
        stacked = {m["key"] for m in c["shape_mismatch"]}
        assert stacked and all(k.startswith("vision_model.decoder.layers.") for k in stacked), describe(c)
        assert all(m["model"][0] == N_BUILT + 1 and m["checkpoint"][0] == N_BUILT for m in c["shape_mismatch"]), describe(c)
        assert not c["ok"]


def test_mcore_llava_names_match_spec(selftest):
    """What megatron-core 0.16.1 builds for the tiny LLaVA at TP 2 is the spec's key set with the spec's shapes."""
    expected = spec_rank_state()
    for r, listing in enumerate(rank_json(selftest, "model")):
        actual = listing["state_dict"]
        assert set(actual) - set(expected) == set() and set(expected) - set(actual) == set(), (
            r, sorted(set(actual) - set(expected)), sorted(set(expected) - set(actual)))
        wrong = {k: (actual[k], expected[k]) for k in expected if actual[k] != expected[k]}
        assert not wrong, (r, wrong)
        sharded = listing["sharded_state_dict"]
        # torch_dist keys: both stacks get a layer axis; the LM's local-spec norms take the TE names, the ViT's not
        assert sharded["language_model.decoder.layers.self_attention.linear_qkv.layer_norm_weight"]["global"] == [L, H]
        assert sharded["vision_model.decoder.layers.input_layernorm.weight"]["global"] == [N_BUILT, HV]
        assert sharded["vision_model.decoder.layers.self_attention.linear_qkv.weight"]["global"] == [N_BUILT, 3 * HV, HV]
        assert sharded["vision_projection.encoder.linear_fc1.weight"]["global"] == [H, HV]
        assert sharded["vision_model.class_token"]["global"] == [1, 1, HV]


# ---- reshard ----

@pytest.fixture(scope="module")
def llava_hf(tmp_path_factory):
    return vlm_cases.save_hub("llava", tmp_path_factory.mktemp("llava_hf") / "hf")


def reshard_convert(src: Path, dst: Path, *args) -> None:
    proc = subprocess.run([sys.executable, "-m", "reshard", "convert", src, dst, *map(str, args)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (f"reshard convert {' '.join(map(str, args))} failed (exit {proc.returncode}):\n"
                                  f"{proc.stderr[-3000:]}{proc.stdout[-1000:]}")


@pytest.fixture(scope="module")
def llava_megatron(llava_hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("llava_megatron") / "megatron"
    reshard_convert(llava_hf, out, "--to", "megatron", "--tp", TP, "--megatron-spec", "local")
    return out


def test_llava_megatron_loads_in_mcore(llava_hf, llava_megatron, tmp_path):
    """The acceptance line: megatron-core's LLaVAModel at TP 2 loads reshard's output strictly on both ranks."""
    harness("load", llava_megatron, tmp_path, "--config", llava_hf / "config.json", "--format", "torch")
    results = rank_json(tmp_path, "result")
    assert all(r["ok"] for r in results), "\n".join(describe(r) for r in results)
    assert all(r["args_padded_vocab"] in (None, VP) for r in results), [r["args_padded_vocab"] for r in results]


def _rank_files(folder: Path, tp: int = TP) -> list[dict]:
    """Each TP rank's ``model`` dict (PP 1), read weights-only as Megatron-LM's loader would."""
    import argparse

    from mcore_args_harness import iteration_dir

    torch.serialization.add_safe_globals([argparse.Namespace])
    it = Path(iteration_dir(str(folder)))
    return [torch.load(it / f"mp_rank_{r:02d}" / "model_optim_rng.pt", map_location="cpu", weights_only=True)["model"]
            for r in range(tp)]


def rule_rank_tensors(hf: dict[str, torch.Tensor], r: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank ``r``'s Megatron tensors built from the HF (Hub spelling) tensors by vlm.md section 4's rules."""
    def rows(t):  # column-parallel: rows [r*n/t, (r+1)*n/t)
        return t.chunk(tp, dim=0)[r]

    def cols(t):  # row-parallel weight: columns [r*n/t, (r+1)*n/t)
        return t.chunk(tp, dim=1)[r]

    tower = "vision_tower.vision_model."
    out = {
        "vision_model.class_token": hf[tower + "embeddings.class_embedding"].view(1, 1, HV),
        "vision_model.conv1.weight": hf[tower + "embeddings.patch_embedding.weight"],
        "vision_model.position_embeddings.weight": hf[tower + "embeddings.position_embedding.weight"],
        "vision_model.ln_pre.weight": hf[tower + "pre_layrnorm.weight"],
        "vision_model.ln_pre.bias": hf[tower + "pre_layrnorm.bias"],
    }
    dv, per_rank = HV // NV, NV // tp
    for b in range(N_BUILT):
        src, dst = f"{tower}encoder.layers.{b}.", f"vision_model.decoder.layers.{b}."
        for kind in ("weight", "bias"):
            q, k, v = (hf[f"{src}self_attn.{x}_proj.{kind}"] for x in "qkv")
            heads = range(r * per_rank, (r + 1) * per_rank)  # per head [q_h; k_h; v_h]
            out[dst + f"self_attention.linear_qkv.{kind}"] = torch.cat(
                [t[h * dv:(h + 1) * dv] for h in heads for t in (q, k, v)])
            out[dst + f"input_layernorm.{kind}"] = hf[f"{src}layer_norm1.{kind}"]
            out[dst + f"pre_mlp_layernorm.{kind}"] = hf[f"{src}layer_norm2.{kind}"]
            out[dst + f"mlp.linear_fc1.{kind}"] = rows(hf[f"{src}mlp.fc1.{kind}"])
        out[dst + "self_attention.linear_proj.weight"] = cols(hf[src + "self_attn.out_proj.weight"])
        out[dst + "self_attention.linear_proj.bias"] = hf[src + "self_attn.out_proj.bias"]
        out[dst + "mlp.linear_fc2.weight"] = cols(hf[src + "mlp.fc2.weight"])
        out[dst + "mlp.linear_fc2.bias"] = hf[src + "mlp.fc2.bias"]
    proj = "multi_modal_projector."
    out.update({
        "vision_projection.encoder.linear_fc1.weight": rows(hf[proj + "linear_1.weight"]),
        "vision_projection.encoder.linear_fc1.bias": rows(hf[proj + "linear_1.bias"]),
        "vision_projection.encoder.linear_fc2.weight": cols(hf[proj + "linear_2.weight"]),
        "vision_projection.encoder.linear_fc2.bias": hf[proj + "linear_2.bias"],
    })
    # Language model: the padded embedding's row block; linear_qkv per KV group [q heads of g; k_g; v_g], groups
    # split over ranks; SwiGLU fc1 [gate_r; up_r].
    lm = "language_model.model."
    multiple = 128 * tp  # Megatron-LM's padding, zero rows
    embed = torch.zeros((V + multiple - 1) // multiple * multiple, H)
    embed[:V] = hf[lm + "embed_tokens.weight"]
    out["language_model.embedding.word_embeddings.weight"] = rows(embed)
    q, k, v = (hf[f"{lm}layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    per_group = NH // NG
    groups = range(r * NG // tp, (r + 1) * NG // tp)
    out["language_model.decoder.layers.0.self_attention.linear_qkv.weight"] = torch.cat(
        [torch.cat([q[g * per_group * D:(g + 1) * per_group * D], k[g * D:(g + 1) * D], v[g * D:(g + 1) * D]])
         for g in groups])
    out["language_model.decoder.layers.0.mlp.linear_fc1.weight"] = torch.cat(
        [rows(hf[lm + "layers.0.mlp.gate_proj.weight"]), rows(hf[lm + "layers.0.mlp.up_proj.weight"])])
    out["language_model.decoder.final_layernorm.weight"] = hf[lm + "norm.weight"]
    return out


@pytest.mark.parametrize("tp", [TP, 1])
def test_llava_megatron_rank_tensors_follow_rules(llava_hf, llava_megatron, tmp_path, tp):
    """Rank r's tensors equal the ones built from the HF source by the spec's rules; nothing past the feature
    layer (CLIP block 2, post_layernorm) is written.  TP 1 too: with one vision head and one KV group per rank at
    TP 2, per-head ``[q_h; k_h; v_h]`` and a blocked ``[q_r; k_r; v_r]`` coincide; with the whole tower on one
    rank they do not."""
    folder = llava_megatron
    if tp != TP:
        folder = tmp_path / "megatron"
        reshard_convert(llava_hf, folder, "--to", "megatron", "--tp", tp, "--megatron-spec", "local")
    hf, _ = vlm_cases.read_tensors(llava_hf)
    for r, stored in enumerate(_rank_files(folder, tp)):
        expected = rule_rank_tensors(hf, r, tp)
        wrong = []
        for name, want in expected.items():
            got = stored.get(name)
            if got is None:
                wrong.append(f"{name}: missing")
            elif got.shape != want.shape:
                wrong.append(f"{name}: shape {tuple(got.shape)}, rule {tuple(want.shape)}")
            elif not torch.equal(got, want):
                wrong.append(f"{name}: max |diff| {(got.float() - want.float()).abs().max().item():.3g}")
        assert not wrong, f"tp {tp} rank {r}:\n  " + "\n  ".join(wrong)
        beyond = [k for k in stored if k.startswith(f"vision_model.decoder.layers.{N_BUILT}.") or "ln_post" in k]
        assert not beyond, beyond


def test_llava_torch_dist_loads_in_mcore(llava_hf, tmp_path):
    """``--to torch_dist``: dist_checkpointing.load into the same model finds every key at its global shape, both
    layer stacks on their own layer axis. Keys only a Transformer Engine model asks for are tolerated, as
    Megatron-LM's default strictness does: ``core_attention._extra_state``, and the ViT norms under their fused
    spelling (``linear_qkv.layer_norm_*``, ``linear_fc1.layer_norm_*``), written beside the local spec's
    ``input_layernorm`` / ``pre_mlp_layernorm`` so either spec's load finds its keys."""
    out = tmp_path / "torch_dist"
    reshard_convert(llava_hf, out, "--to", "torch_dist", "--tp", TP)
    harness("load", out, tmp_path / "result", "--config", llava_hf / "config.json", "--format", "torch_dist")
    results = rank_json(tmp_path / "result", "result")
    fused = {"vision_model.decoder.layers.self_attention.linear_qkv.layer_norm_weight",
             "vision_model.decoder.layers.self_attention.linear_qkv.layer_norm_bias",
             "vision_model.decoder.layers.mlp.linear_fc1.layer_norm_weight",
             "vision_model.decoder.layers.mlp.linear_fc1.layer_norm_bias"}
    for r in results:
        assert set(r["unexpected"]) <= fused, describe(r)
        r["ok"] = not (r["missing"] or r["shape_mismatch"] or r["replica_mismatch"] or r["load_error"])
        assert r["loaded_equal"] is not False, describe(r)
    assert all(r["ok"] for r in results), "\n".join(describe(r) for r in results)
