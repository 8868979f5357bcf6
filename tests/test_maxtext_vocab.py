"""MaxText's vocab_size on ``--to maxtext`` (maxtext-orbax.md sections 4.5, 4.6, 7.6): the released Gemma 1/2
vocab (256000) is padded to MaxText's 256128, Gemma 3's 262208 truncated to 262144 only with
``--allow-lossy-config vocab``; ``--maxtext-vocab-size N`` for any other model; the reader crops the padding."""

from __future__ import annotations

import glob
import os

import pytest

from helpers import run_cli

import reshard
from reshard.errors import PlanError

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "maxtext")


def conventions(model: str, architecture: str):
    from reshard.mapping.maxtext_names import family_table
    from reshard.mapping_vlm import family_for_architecture

    return family_table(family_for_architecture(architecture, None, {})).conventions(architecture, model, "test")


def test_model_name_vocab():
    """MaxText's configs (gemma*-*.yml vocab_size 256128, gemma3-*.yml 262144; section 4.6) for the released HF
    vocab; any other HF vocab (fine-tuned, tiny) is kept unless --maxtext-vocab-size says otherwise."""
    from reshard.mapping.maxtext_names import maxtext_vocab

    gemma2 = conventions("gemma2-9b", "Gemma2ForCausalLM")
    assert maxtext_vocab(gemma2, 256000, None, False) == 256128
    assert maxtext_vocab(conventions("gemma-7b", "GemmaForCausalLM"), 256000, None, False) == 256128
    assert maxtext_vocab(gemma2, 256, None, False) == 256
    assert maxtext_vocab(gemma2, 256, 320, False) == 320
    gemma3 = conventions("gemma3-4b", "Gemma3ForCausalLM")
    with pytest.raises(PlanError, match="262144 is smaller than the model's vocab 262208.*--allow-lossy-config vocab"):
        maxtext_vocab(gemma3, 262208, None, False)
    assert maxtext_vocab(gemma3, 262208, None, True) == 262144
    assert maxtext_vocab(gemma3, 262144, None, False) == 262144  # gemma-3-1b: equal
    llama = conventions("llama3.1-8b", "LlamaForCausalLM")
    assert maxtext_vocab(llama, 128256, None, False) == 128256
    with pytest.raises(PlanError, match="--maxtext-vocab-size 0"):
        maxtext_vocab(llama, 128256, 0, False)


def test_truncation_refused(capsys, tmp_path):
    """Section 7.6: fewer MaxText rows than HF's is refused, one line, exit 2, nothing written."""
    hf = os.path.join(FIXTURES, "gemma2", "hf")
    out = tmp_path / "mt"
    code, _, err = run_cli(capsys, "convert", hf, out, "--to", "maxtext", "--maxtext-model", "gemma2-2b",
                           "--maxtext-vocab-size", 200)
    message = err.strip()
    assert code == 2 and "\n" not in message and "--allow-lossy-config vocab" in message, err
    assert "smaller than the model's vocab 256" in message
    assert not out.exists()


def _load(folder: str) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))) for k, v in load_file(f).items()}


@pytest.mark.slow
def test_untied_padding_and_lossy_truncation(tmp_path):
    """An untied Llama padded to 300 rows: embedding rows and head columns 256.. are zeros, the provenance records
    300, and the way back gives the HF tensors bit for bit; Gemma 2 truncated with --allow-lossy-config vocab
    reads back as the first 200 rows."""
    from reshard.io.orbax_store import Item
    from reshard.layouts.maxtext_folders import locate

    hf = os.path.join(FIXTURES, "llama31", "hf")
    reshard.convert(hf, str(tmp_path / "mt"), to="maxtext", maxtext_model="llama3.1-8b", maxtext_vocab_size=300)
    item = Item(str(tmp_path / "mt" / "0" / "items"))
    emb = item.read("params.params.token_embedder.embedding").astype("float32")
    head = item.read("params.params.decoder.logits_dense.kernel").astype("float32")
    assert emb.shape[0] == 300 and head.shape[1] == 300 and not emb[256:].any() and not head[:, 256:].any()
    assert emb[:256].any() and head[:, :256].any()
    assert locate(str(tmp_path / "mt"), None).custom["reshard"]["maxtext_vocab_size"] == 300
    reshard.convert(str(tmp_path / "mt"), str(tmp_path / "back"), to="hf")
    got, want = _load(str(tmp_path / "back")), _load(hf)
    assert set(got) == set(want) and all(got[k].equal(want[k]) for k in want)

    g2 = os.path.join(FIXTURES, "gemma2", "hf")
    reshard.convert(g2, str(tmp_path / "g2"), to="maxtext", maxtext_model="gemma2-2b", maxtext_vocab_size=200,
                    allow_lossy_config=("vocab",))
    reshard.convert(str(tmp_path / "g2"), str(tmp_path / "g2hf"), to="hf")
    got, want = _load(str(tmp_path / "g2hf")), _load(g2)
    assert got["model.embed_tokens.weight"].equal(want["model.embed_tokens.weight"][:200])


@pytest.mark.slow
def test_maxtext_to_maxtext_keeps_the_vocab(tmp_path):
    """A MaxText source's vocab_size (to_maxtext's Gemma 2 fixture: 320 rows) is the default of the MaxText it is
    written to: the zero rows stay, the provenance records 320, and the HF rows equal the source's."""
    from reshard.io.orbax_store import Item
    from reshard.layouts.maxtext_folders import locate

    path = os.path.join(FIXTURES, "gemma2")
    src = os.path.join(path, "maxtext_scan")
    reshard.convert(src, str(tmp_path / "mt"), to="maxtext", config=os.path.join(path, "hf", "config.json"),
                    maxtext_model="gemma2-2b", maxtext_match_converter=True)
    leaf = "params.params.token_embedder.embedding"
    ours, theirs = Item(str(tmp_path / "mt" / "0" / "items")).read(leaf), Item(os.path.join(src, "0", "items")).read(leaf)
    assert ours.shape == theirs.shape == (320, 32) and ours.tobytes() == theirs.tobytes()
    assert locate(str(tmp_path / "mt"), None).custom["reshard"]["maxtext_vocab_size"] == 320
