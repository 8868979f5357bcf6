"""tests/mcore_args_harness.py for a run whose args set ``position_embedding_type = "yarn"`` (standard attention).

Run as ``python tests/mcore_yarn_harness.py CKPT_DIR IDS.pt OUT.pt --nproc-per-node 2``. Everything is that
harness's (rank files, TransformerConfig and GPTModel from the args, strict load, forward, gathered logits); the one
addition is Megatron-LM's: the ``yarn_*`` args become attributes of the TransformerConfig, which ``GPTModel`` reads
by ``getattr`` to build ``YarnRotaryEmbedding`` and attention reads for its cos/sin factor (they are not
TransformerConfig fields). ``--drop-arg yarn_mscale`` etc. builds as if the args lacked one.
"""

from __future__ import annotations

import sys

import mcore_args_harness as harness

YARN = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
        "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int")
_plain_config = harness.config_from_args


def config_from_args(get, **plumbing):
    config = _plain_config(get, **plumbing)
    for key in YARN:
        setattr(config, key, get(key))
    return config


harness.config_from_args = config_from_args  # also in the spawned ranks: they re-run this module's top level

if __name__ == "__main__":
    sys.exit(harness.main())
