"""maxtext layout against MaxText itself (maxtext-orbax.md section 7.7): tiny checkpoints MaxText 0.2.5 made
(tests/fixtures/maxtext/<case>/, see its README.md): reshard reads ``to_maxtext``'s scanned and unscanned outputs
into exactly what MaxText's own ``to_huggingface`` wrote, bit for bit."""

from __future__ import annotations

import json
import os

import pytest

from test_maxtext_build import np_of

import reshard

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "maxtext")
CASES = ("llama31", "qwen3", "mixtral", "gemma2", "deepseek3")
#: run by default (the rest: -m slow), one per direction
DEFAULT = {("reader", "llama31", "scan"), ("writer", "gemma2", "scan")}


def cases(direction: str):
    return [pytest.param(c, s, marks=() if (direction, c, s) in DEFAULT else pytest.mark.slow, id=f"{c}-{s}")
            for c in CASES for s in ("scan", "unscan")]


def case_dir(case: str, *parts: str) -> str:
    path = os.path.join(FIXTURES, case)
    if not all(os.path.exists(os.path.join(path, p)) for p in parts):
        pytest.skip(f"fixture {case} is not in tests/fixtures/maxtext (made by MaxText in a Python 3.12 venv)")
    return path


def model_name(path: str) -> str | None:
    meta = os.path.join(path, "maxtext.json")
    if os.path.isfile(meta):
        with open(meta) as f:
            return json.load(f).get("maxtext_model_name")
    return None


def maxtext_vocab(path: str) -> int | None:
    """The ``vocab_size`` MaxText was run with (its overrides in maxtext.json), None when not overridden."""
    with open(os.path.join(path, "maxtext.json")) as f:
        overrides = json.load(f).get("maxtext_overrides", [])
    return next((int(o.split("=", 1)[1]) for o in overrides if o.startswith("vocab_size=")), None)


def load(folder: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


@pytest.mark.parametrize("case,scan", cases("reader"))
def test_reader_equals_maxtext_to_huggingface(case, scan, tmp_path):
    path = case_dir(case, f"maxtext_{scan}/0/_CHECKPOINT_METADATA", f"to_hf_{scan}", "hf/config.json", "maxtext.json")
    out = tmp_path / "hf"
    reshard.convert(os.path.join(path, f"maxtext_{scan}", "0"), str(out), to="hf",
                    config=os.path.join(path, "hf", "config.json"), maxtext_model=model_name(path))
    got, want = load(str(out)), load(os.path.join(path, f"to_hf_{scan}"))
    assert set(got) == set(want)
    step = os.path.join(path, f"maxtext_{scan}")  # a folder of steps: step 0
    config = os.path.join(path, "hf", "config.json")
    info = reshard.inspect(step, config=config, maxtext_model=model_name(path))
    assert info["maxtext"]["scan_layers"] == (scan == "scan")
    assert info["maxtext"]["unstack_pass"].startswith("yes" if scan == "scan" else "no")  # to_maxtext's chunks
    report = reshard.verify(step, os.path.join(path, f"to_hf_{scan}"), config=config, maxtext_model=model_name(path))
    assert [t.status for t in report.tensors] == ["equal"] * len(want)  # (MaxText writes its own config.json)
    differ = [k for k in want if got[k].dtype != want[k].dtype
              or np_of(got[k]).tobytes() != np_of(want[k]).tobytes()]
    assert differ == []


@pytest.mark.parametrize("case,scan", cases("writer"))
def test_writer_equals_maxtext_to_maxtext(case, scan, tmp_path):
    """``--to maxtext --maxtext-match-converter --maxtext-vocab-size`` (MaxText's vocab_size) from the HF model
    MaxText converted: every leaf value equals ``to_maxtext``'s, the zero rows MaxText pads the vocab with
    included (Gemma 2: 320 rows for HF's 256); chunking may differ."""
    from reshard.io.orbax_store import Item

    path = case_dir(case, f"maxtext_{scan}/0/_CHECKPOINT_METADATA", "hf/config.json", "maxtext.json")
    out = tmp_path / "mt"
    reshard.convert(os.path.join(path, "hf"), str(out), to="maxtext", maxtext_model=model_name(path),
                    scan_layers=scan == "scan", maxtext_match_converter=True, maxtext_vocab_size=maxtext_vocab(path))
    ours, theirs = Item(str(out / "0" / "items")), Item(os.path.join(path, f"maxtext_{scan}", "0", "items"))
    params = sorted(n for n in theirs.paths if n.startswith("params."))
    assert sorted(n for n in ours.paths if n.startswith("params.")) == params
    differ = []
    for name in params:
        a, b = ours.read(name), theirs.read(name)
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            differ.append(name)
    assert differ == []


@pytest.mark.slow
@pytest.mark.parametrize("scan", ["scan", "unscan"])
def test_trainer_checkpoint_logits(scan, tmp_path):
    """Spec 7.7.4: a checkpoint MaxText's trainer wrote (2 steps, fp32; the run's checkpoints/ folder, newest step)
    -> HF; transformers' logits equal MaxText's own forward of that checkpoint within 1e-5."""
    import torch
    import transformers
    from safetensors.torch import load_file

    path = case_dir("train_default", f"{scan}/checkpoints", "logits.safetensors", "maxtext.json")
    out = tmp_path / "hf"
    result = reshard.convert(os.path.join(path, scan), str(out), to="hf", maxtext_model=model_name(path),
                             config=os.path.join(path, "tiny_default_config.json"))
    assert any("optimizer state is not converted" in n for n in result.notes)
    oracle = load_file(os.path.join(path, "logits.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert next(model.parameters()).dtype == torch.float32  # fp32 leaves, fp32 output: nothing rounded
    with torch.no_grad():
        logits = model(oracle["input_ids"]).logits[0]
    assert (logits - oracle[f"maxtext_{scan}"]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("variant", ["ocdbt_zarr3", pytest.param("ocdbt_zarr2", marks=pytest.mark.slow),
                                     pytest.param("file_zarr3", marks=pytest.mark.slow), "file_zarr2"])
def test_storage_variants_made_by_orbax(variant, tmp_path):
    """Spec 7.7.5: the four storage variants Orbax writes (OCDBT or per-array, zarr3 or zarr2, 2 devices): every
    leaf reads back as saved (values.safetensors: the saved bf16 values widened), and converts to HF."""
    from safetensors.torch import load_file

    from reshard.io.orbax_store import Item

    path = case_dir("orbax_variants", variant, "values.safetensors")
    oracle = load_file(os.path.join(path, "values.safetensors"))
    item = Item(os.path.join(path, variant, "7", "items"))
    for name, want in oracle.items():
        got = item.read(name)
        assert got.dtype.name == "bfloat16" and np_of_f32(got).tobytes() == want.numpy().tobytes(), name
    with open(os.path.join(path, "maxtext.json")) as f:
        d = json.load(f)["dims"]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d["H"],
              "num_hidden_layers": d["L"], "num_attention_heads": d["NH"], "num_key_value_heads": d["NKV"],
              "head_dim": d["HD"], "intermediate_size": d["F"], "vocab_size": d["V"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    reshard.convert(os.path.join(path, variant), str(tmp_path / "hf"), to="hf", config=str(tmp_path / "config.json"),
                    maxtext_model="llama2-7b", dtype="fp32")
    got = load(str(tmp_path / "hf"))
    wi0 = oracle["params.params.decoder.layers.mlp.wi_0.kernel"][:, 2].t()
    assert got["model.layers.2.mlp.gate_proj.weight"].equal(wi0)


def np_of_f32(x):
    return x.astype("float32")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama31", "qwen3"])
def test_maxtext_hf_maxtext_round_trip(case, tmp_path):
    """Spec 7.7.6: MaxText -> HF -> MaxText (MaxText's rounding) is bit-exact except the query kernels MaxText
    pre-scales by an inexact 1/sqrt(d), which move at most one ulp (Qwen3 has no pre-scale: all bit-exact)."""
    import numpy as np

    from reshard.io.orbax_store import Item

    path = case_dir(case, "maxtext_scan/0/_CHECKPOINT_METADATA", "hf/config.json", "maxtext.json")
    name = model_name(path)
    reshard.convert(os.path.join(path, "maxtext_scan"), str(tmp_path / "hf"), to="hf", maxtext_model=name,
                    config=os.path.join(path, "hf", "config.json"))
    reshard.convert(str(tmp_path / "hf"), str(tmp_path / "mt"), to="maxtext", maxtext_model=name,
                    maxtext_match_converter=True)
    a, b = Item(os.path.join(path, "maxtext_scan", "0", "items")), Item(str(tmp_path / "mt" / "0" / "items"))
    moved = {}
    for leaf in (n for n in a.paths if n.startswith("params.")):
        x, y = a.read(leaf), b.read(leaf)
        assert x.shape == y.shape and x.dtype == y.dtype, leaf
        ulps = np.abs(x.view(np.int16).astype(np.int32) - y.view(np.int16).astype(np.int32))
        if ulps.any():
            moved[leaf] = int(ulps.max())
    if case == "qwen3":
        assert moved == {}
    else:
        assert set(moved) <= {"params.params.decoder.layers.self_attention.query.kernel"}
        assert max(moved.values(), default=1) == 1
