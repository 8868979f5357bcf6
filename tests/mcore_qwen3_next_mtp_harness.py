"""megatron-core 0.16.1's Qwen3-Next-shaped GPTModel (tests/mcore_qwen3_next_harness.py's CPU build) with its own
multi-token-prediction block: ``mtp_num_layers`` from the checkpoint's args and megatron-core's
``get_gpt_mtp_block_spec`` over the decoder block spec (whose last layer, full attention + MoE, the MTP layer copies).
The ``torch_dist`` folder is loaded strictly (Megatron-LM's default strictness, then ``load_state_dict(strict=True)``),
the MTP layer's local-spec ``input_layernorm`` read under the key a Transformer Engine run saves
(``…transformer_layer.self_attention.linear_qkv.layer_norm_weight``); no forward. Each rank r writes
``OUT.pt.rank{r}``: its ``mtp.*`` parameters as megatron-core names them, values as loaded.

Run as::

    python tests/mcore_qwen3_next_mtp_harness.py load --ids IDS.pt [--tp T --ep E --etp S] CKPT OUT.pt
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mcore_qwen3_next_harness as qn  # noqa: E402  (prepares megatron-core for the CPU)
import mcore_glm_harness  # noqa: E402
from mcore_dist_harness import read_common  # noqa: E402
from mcore_mla_harness import iteration_dir  # noqa: E402

torch = qn.torch
TE_NORM = "transformer_layer.self_attention.linear_qkv.layer_norm_weight"


def with_mtp_block(layers: int) -> None:
    """megatron-core's GPTModel, as build_model imports it, built with ``layers`` MTP layers from its own spec."""
    import megatron.core.models.gpt as gpt
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    real = gpt.GPTModel

    def build(config, transformer_layer_spec, **kw):
        config.mtp_num_layers = layers
        spec = get_gpt_mtp_block_spec(config, transformer_layer_spec, use_transformer_engine=False)
        return real(config=config, transformer_layer_spec=transformer_layer_spec, mtp_block_spec=spec, **kw)

    gpt.GPTModel = build


def te_mtp_keys(sharded: dict) -> dict:
    for item in sharded.values():
        key = getattr(item, "key", None) or ""
        if key.startswith("mtp.layers.") and key.endswith("transformer_layer.input_layernorm.weight"):
            item.key = key[:-len("transformer_layer.input_layernorm.weight")] + TE_NORM
    return sharded


def load_one(cli, ckpt: str, out: str, input_ids) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.validation import StrictHandling

    qn.fla_stand_ins()
    folder = iteration_dir(ckpt)
    common = read_common(folder)
    args = common["args"]
    with_mtp_block(int(args.mtp_num_layers or 0))
    model = qn.build_model(args, cli.tp, cli.ep, cli.etp)
    assert len(model.mtp.layers) == args.mtp_num_layers
    metadata = dict(common.get("content_metadata") or {})
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    sharded = te_mtp_keys(qn.te_keys(model.sharded_state_dict(metadata=metadata), args.linear_attention_freq))
    loaded = dist_checkpointing.load({"model": sharded}, folder, strict=StrictHandling.ASSUME_OK_UNEXPECTED)["model"]
    result = model.load_state_dict(loaded, strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()
                if k.startswith("mtp.") and isinstance(v, torch.Tensor)}, f"{out}.rank{dist.get_rank()}")
    dist.barrier()


mcore_glm_harness.load_one = load_one  # patched at import: the spawned workers import this script first


if __name__ == "__main__":
    sys.exit(mcore_glm_harness.main())
