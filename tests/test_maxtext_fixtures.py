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


def load(folder: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


@pytest.mark.parametrize("case,scan", cases("reader"))
def test_reader_equals_maxtext_to_huggingface(case, scan, tmp_path):
    path = case_dir(case, f"maxtext_{scan}/0/_CHECKPOINT_METADATA", f"to_hf_{scan}", "hf/config.json")
    out = tmp_path / "hf"
    reshard.convert(os.path.join(path, f"maxtext_{scan}", "0"), str(out), to="hf",
                    config=os.path.join(path, "hf", "config.json"), maxtext_model=model_name(path))
    got, want = load(str(out)), load(os.path.join(path, f"to_hf_{scan}"))
    assert set(got) == set(want)
    differ = [k for k in want if got[k].dtype != want[k].dtype
              or np_of(got[k]).tobytes() != np_of(want[k]).tobytes()]
    assert differ == []


@pytest.mark.parametrize("case,scan", cases("writer"))
def test_writer_equals_maxtext_to_maxtext(case, scan, tmp_path):
    """``--to maxtext --maxtext-match-converter`` from the HF model MaxText converted: every leaf value equals
    ``to_maxtext``'s (chunking may differ; rows MaxText pads the vocab with are zeros)."""
    from reshard.io.orbax_store import Item

    path = case_dir(case, f"maxtext_{scan}/0/_CHECKPOINT_METADATA", "hf/config.json")
    out = tmp_path / "mt"
    reshard.convert(os.path.join(path, "hf"), str(out), to="maxtext", maxtext_model=model_name(path),
                    scan_layers=scan == "scan", maxtext_match_converter=True)
    ours, theirs = Item(str(out / "0" / "items")), Item(os.path.join(path, f"maxtext_{scan}", "0", "items"))
    params = sorted(n for n in theirs.paths if n.startswith("params."))
    assert sorted(n for n in ours.paths if n.startswith("params.")) == params
    differ = []
    for name in params:
        a, b = ours.read(name), theirs.read(name)
        if a.shape != b.shape and name.endswith("token_embedder.embedding"):
            assert not b[a.shape[0]:].any()
            b = b[:a.shape[0]]
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            differ.append(name)
    assert differ == []
