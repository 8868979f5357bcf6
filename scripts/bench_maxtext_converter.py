#!/usr/bin/env python
"""MaxText's own converter as a bench row (``maxtext_converter_to_maxtext`` / ``maxtext_converter_to_hf``), run
under the MaxText interpreter named by ``RESHARD_MAXTEXT_PYTHON`` (Python 3.12, maxtext 0.2.5, jax CPU) on the
same generated Llama the reshard rows use: ``to_maxtext`` (lazy load, bf16, 2 simulated devices, scanned, OCDBT +
zarr3) of the bench's HF source, and ``to_huggingface`` (bf16, scanned) of the ``maxtext_converter`` source. Model
name ``llama3.1-8b`` (MaxText's Llama param map; the converters read no RoPE scaling) with
``override_model_config`` and the source's sizes, MaxText's table of HF configs patched with the source's
config.json, exactly as scripts/maxtext_fixtures/make_fixtures.py runs them (its ``mt_*`` steps are reused).

    $RESHARD_MAXTEXT_PYTHON scripts/bench_maxtext_converter.py to_maxtext HF_SRC DST
    $RESHARD_MAXTEXT_PYTHON scripts/bench_maxtext_converter.py to_hf MAXTEXT_SRC DST
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

MODEL = "llama3.1-8b"
ENV = "RESHARD_MAXTEXT_PYTHON"


def overrides(cfg: dict) -> list[str]:
    """MaxText command-line overrides for a Llama HF config."""
    heads = cfg["num_attention_heads"]
    values = {"base_emb_dim": cfg["hidden_size"], "base_num_query_heads": heads,
              "base_num_kv_heads": cfg.get("num_key_value_heads", heads), "base_mlp_dim": cfg["intermediate_size"],
              "base_num_decoder_layers": cfg["num_hidden_layers"],
              "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads, "vocab_size": cfg["vocab_size"],
              "rope_max_timescale": int(cfg.get("rope_theta") or 10000),
              "normalization_layer_epsilon": cfg.get("rms_norm_eps", 1e-5)}
    return [f"{k}={v}" for k, v in values.items()]


def command(op: str, src: Path, dst: Path) -> list[str]:
    """The bench child for ``op``; without RESHARD_MAXTEXT_PYTHON a child that prints one line and exits 2."""
    python = os.environ.get(ENV)
    if not python:
        msg = f"{op}: set {ENV} to a Python with MaxText installed (scripts/maxtext_fixtures/README.md) to time it"
        print(f"[bench] {msg}", file=sys.stderr, flush=True)
        return [sys.executable, "-c", f"import sys; print({msg!r}, file=sys.stderr); sys.exit(2)"]
    return [python, str(Path(__file__).resolve()), op.removeprefix("maxtext_converter_"), str(src), str(dst)]


def main(argv: list[str]) -> int:
    op, src, dst = argv[0], Path(argv[1]).resolve(), Path(argv[2]).resolve()
    sys.path.insert(0, str(Path(__file__).resolve().parent / "maxtext_fixtures"))
    import make_fixtures as mf

    if op == "to_maxtext":
        cfg = json.loads((src / "config.json").read_text())
        mf.mt_to_maxtext({"model_name": MODEL, "hf_dir": str(src), "out": str(dst), "scan": True,
                          "overrides": overrides(cfg)})
        return 0
    meta = json.loads((src / "0" / "_CHECKPOINT_METADATA").read_text())
    cfg = meta["custom_metadata"]["reshard"]["hf_config"]
    with tempfile.TemporaryDirectory() as hf_dir:  # the converter reads the HF architecture from a config.json
        Path(hf_dir, "config.json").write_text(json.dumps(cfg))
        mf.mt_to_huggingface({"model_name": MODEL, "hf_dir": hf_dir, "items": str(src / "0" / "items"),
                              "out": str(dst), "scan": True, "overrides": overrides(cfg)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
