"""The pieces of a torchrun conversion that run inside one process, on torch's own in-memory c10d store
(``torch.distributed.HashStore``, the store interface torchrun's TCPStore implements): progress summed over ranks
and shown by rank 0 only, a posted failure stopping the other ranks' writers, the same file partition computed by
every rank, and the rank prefix of log lines. The whole protocol over real processes is tests/test_torchrun.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from reshard.distributed import ProgressRelay, RankFailed, World, log_prefix


class Bar:
    def __init__(self):
        self.n = 0

    def update(self, n: int) -> None:
        self.n += n


def worlds(size: int = 2) -> list[World]:
    store = dist.HashStore()
    return [World(rank, size, None, store, owns_group=False, prefix="reshard/test") for rank in range(size)]


def test_rank_zero_shows_the_bytes_of_every_rank():
    zero, one = worlds()
    bar = Bar()
    shown, quiet = ProgressRelay(zero, bar), ProgressRelay(one, None)
    try:
        quiet(70 << 20)  # over FLUSH_BYTES: sent at once
        shown(3 << 20)
        quiet(5 << 20)  # pending until close
    finally:
        quiet.close()
        shown.close()
    assert zero.store.add(zero.bytes_key, 0) == (70 + 3 + 5) << 20
    assert bar.n == (70 + 3 + 5) << 20  # rank 0 closes last here: its bar shows the world's total


def test_a_posted_failure_stops_the_other_ranks_at_their_next_report():
    zero, one = worlds()
    relay = ProgressRelay(one, None)
    relay(1 << 20)
    zero.post_failure("disk full")
    relay.last = 0.0  # the next report flushes (as it would FLUSH_S later)
    with pytest.raises(RankFailed, match=r"rank 0 of 2 failed: disk full"):
        relay(1 << 20)
    assert one.failure() == "rank 0 of 2 failed: disk full"


def test_log_prefix(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert log_prefix() == "[rank 3] "
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert log_prefix() == ""
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert log_prefix() == ""


def test_every_rank_computes_the_same_partition(tmp_path):
    """The split of the files is a pure function of the plan: computed twice (as two ranks do), it is the same,
    covers every file once and gives every rank a share
    (lockstep units are halved until there are enough, so the split is balanced to within a unit)."""
    from checkpoints import make_hf
    from reshard.conversion import make_plan
    from reshard.execute import partition
    from reshard.layouts import open_checkpoint
    from reshard.layouts.base import Options

    src = make_hf(tmp_path / "hf", hidden=256, heads=8, kv_heads=4, ffn=512, vocab=500, layers=4)
    opts = Options(tp=4, pp=2)
    shares = []
    for _ in range(2):
        with open_checkpoint(src, opts) as source:
            plan, _ = make_plan(source, "megatron", opts)
            shares.append(partition(plan, source.files, 3))
    assert shares[0] == shares[1]
    files = sorted(i for share in shares[0] for unit in share for i in unit)
    assert files == list(range(len(plan.files)))
    loads = [sum(plan.files[i].nbytes for unit in share for i in unit) for share in shares[0]]
    biggest = max(f.nbytes for f in plan.files)
    assert len(loads) == 3 and sum(loads) == plan.nbytes and max(loads) <= 2 * min(loads) + biggest
