"""Messages as a user meets them (issue 43, items 6, 7, 8 and 10): a config-less HF folder, ``verify`` of two
different models, ``live.transfer`` given shards of another degree, and ``inspect`` within 80 columns."""

from __future__ import annotations

import pytest
import torch

import reshard
from checkpoints import make_hf
from reshard import live
from reshard.errors import PlanError


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return make_hf(tmp_path_factory.mktemp("llama") / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)


# -- item 8: live.transfer given shards made for another degree --------------------------------------------------

def _refusal(plan, local: dict) -> str:
    """The message source rank 0 of ``plan`` gets for the first of ``local``'s tensors unlike the plan's."""
    from reshard.live.transfer import _Local

    view = _Local(plan, 0, local, [])
    with pytest.raises(PlanError) as info:
        for name in local:
            view[name]
    return str(info.value)


def test_live_shards_of_another_degree_name_the_degree_not_a_dtype(llama):
    plan = live.plan(llama, source={"layout": "megatron", "tp": 2}, target={"layout": "vllm", "tp": 1},
                     source_ranks=[0, 1], target_ranks=[2])
    message = _refusal(plan, reshard.load_rank(llama, to="megatron", tp=1, rank=0))
    assert "dtype" not in message and "\n" not in message, message
    assert "look made for TP 1" in message and "megatron at TP 2, PP 1" in message, message
    assert "[1024, 64]; the plan expects [512, 64]" in message and "tp=2, pp=1" in message, message
    cast = {k: v.to(torch.bfloat16) for k, v in reshard.load_rank(llama, to="megatron", tp=2, rank=0).items()}
    message = _refusal(plan, cast)  # the right degree, another dtype: the dtype to pass, and no degree
    assert "source={..., 'dtype': 'bfloat16'}" in message and "degree" not in message, message
