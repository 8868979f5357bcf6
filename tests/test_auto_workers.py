"""The automatic process count of convert and digest verify (``--workers`` left out, ``workers=None``): chosen from
the cores, the memory available and the bytes, and reported with the reason; verify's workers claim batches of
tensor pairs, largest first."""

from __future__ import annotations

import pytest

import reshard
from reshard import machine
from reshard.demo import make_demo_checkpoint
from reshard.io import heads
from reshard.verification import digest_run

GIB, MIB = 1 << 30, 1 << 20


@pytest.mark.parametrize("cores, available, nbytes, per, want, bound_by", [
    (16, 125 * GIB, 16 * GIB, 2, 8, "16 cores"),   # verify on a 16-core node: 8, not 1 (nor 16 competing streams)
    (16, 125 * GIB, 16 * GIB, 1, 8, "16 cores"),   # convert: at most 8
    (64, 500 * GIB, 64 * GIB, 2, 8, "64 cores"),
    (2, 23 * GIB, 16 * GIB, 2, 1, "2 cores"),      # verify on 2 cores: one process keeps both busy
    (2, 23 * GIB, 16 * GIB, 1, 2, "2 cores"),      # convert on 2 cores
    (16, int(2.5 * GIB), 16 * GIB, 2, 2, "2 GiB available"),  # little memory available: one process per GiB
    (16, 125 * GIB, 600 * MIB, 2, 2, "600 MiB to process"),   # few bytes: at least 256 MiB each
    (16, 125 * GIB, 8 * MIB, 2, 1, "8 MiB to process"),
    (1, 125 * GIB, 16 * GIB, 1, 1, "1 core"),
])
def test_choice_is_the_tightest_limit_and_names_it(cores, available, nbytes, per, want, bound_by):
    chosen, why = machine.choose_workers(nbytes, 256 * MIB, cores_per_process=per, cores=cores, available=available)
    assert chosen == want
    assert why == f"{want} process{'es' if want > 1 else ''} chosen for {bound_by}"


def test_unknown_memory_does_not_limit(monkeypatch):
    assert machine.choose_workers(16 * GIB, 256 * MIB, cores=16, available=None)[0] == 8 or \
        machine.available_memory() is not None  # available=None reads /proc/meminfo where there is one
    monkeypatch.setattr(machine, "available_memory", lambda: None)
    chosen, why = machine.choose_workers(16 * GIB, 256 * MIB, cores=16)
    assert (chosen, why) == (8, "8 processes chosen for 16 cores")


def test_batches_claim_largest_first_and_cover_every_pair_once():
    class Pair:
        def __init__(self, nbytes):
            self.nbytes = nbytes

    sizes = [5 * MIB, 900 * MIB, 3 * MIB, 700 * MIB, 1 * MIB, 2 * MIB, 600 * MIB, 4 * MIB]
    tasks = [Pair(n) for n in sizes]
    batches = digest_run.batches_of(tasks, 4)
    assert sorted(i for b in batches for i in b) == list(range(len(sizes)))
    assert batches[:3] == [[1], [3], [6]]  # the large pairs alone, largest first
    assert all(b == sorted(b) for b in batches)  # a batch reads in checkpoint order
    assert digest_run.processes_for(tasks, 4) == 4 and digest_run.processes_for(tasks, 1) == 1
    assert digest_run.processes_for(tasks[:1], 4) == 1


def test_read_ahead_is_shared_by_the_processes_of_a_run(monkeypatch):
    whole = heads.read_ahead_window()
    monkeypatch.setattr(heads, "_SHARERS", 1)
    heads.share_read_ahead(4)
    assert heads.read_ahead_window() == max(64 * MIB, whole // 4)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("auto")
    src = make_demo_checkpoint(str(base / "hf"))
    dst = str(base / "meg")
    reshard.convert(src, dst, to="megatron", tp=2, pp=2, workers=1)
    return src, dst


def test_api_verify_and_convert_choose_by_default_and_say_so(pair, tmp_path, monkeypatch):
    src, dst = pair
    monkeypatch.setattr(machine, "usable_cores", lambda: 16)
    monkeypatch.setattr(machine, "available_memory", lambda: 125 * GIB)
    monkeypatch.setattr("reshard.verification.digest.VERIFY_MIN_BYTES", 256 << 10)  # the demo: 8 MiB in all
    from reshard import workers as workers_mod

    forks = []
    real = workers_mod.run_in_workers
    monkeypatch.setattr(workers_mod, "run_in_workers", lambda shares, *a, **k: forks.append(len(shares)) or
                        real(shares, *a, **k))
    report = reshard.verify(src, dst)
    assert report.equal and report.workers == forks[0] > 1
    assert report.workers_reason == "8 processes chosen for 16 cores"
    one = reshard.verify(src, dst, workers=1)
    assert one.workers == 1 and one.workers_reason == "1 process asked for"
    assert [t.sha256_b for t in one.tensors] == [t.sha256_b for t in report.tensors]
    result = reshard.convert(src, str(tmp_path / "out"), to="megatron", tp=2)
    assert result.workers == 1 and result.workers_reason == "1 process chosen for 4 MiB to process"


def test_api_refuses_workers_in_its_own_terms(pair):
    src, dst = pair
    for bad in (0, -1, 1.5, True):
        with pytest.raises(reshard.ReshardError, match=r"workers must be a whole number of at least 1, or None"):
            reshard.verify(src, dst, workers=bad)
