"""``torchrun ... -m reshard convert``: the target files split over a torch.distributed world, written into one
staging folder, published by rank 0.

Proves, for megatron tp 4, vllm tp 2 and hf targets, that a 2-process run on one machine (``--standalone``) and a
run over two "nodes" (two torchrun invocations meeting at a c10d rendezvous on 127.0.0.1) write byte-identical
trees to a single-process run; that both ranks write (each writes a share of the files); and that a run in which
one rank fails (a file size limit on one node) exits non-zero on every rank, names the failing rank, publishes
nothing and leaves no staging folder or lock. Every process a test starts is gone when it ends.
"""

from __future__ import annotations

import filecmp
import os
import resource
import signal
import socket
import subprocess
import sys
import uuid

import pytest

import reshard
from checkpoints import make_hf
from helpers import processes_tagged
from tree_snapshot import leftovers, snapshot

TARGETS = {"megatron-tp4": ["--to", "megatron", "--tp", "4"], "vllm-tp2": ["--to", "vllm", "--tp", "2"],
           "hf": ["--to", "hf", "--max-shard-size", "3MB"]}
TIMEOUT = 240


def targets(default: str) -> list:
    """Every target, ``default`` in the default suite and the others with ``-m slow`` (each torchrun run starts
    2 or 3 interpreters that import torch: about 7 s here)."""
    return [t if t == default else pytest.param(t, marks=pytest.mark.slow) for t in sorted(TARGETS)]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    # 4 layers, about 10 MiB: several target files for every target (hf in 3 MB shards), so both ranks get some.
    return make_hf(tmp_path_factory.mktemp("torchrun") / "hf", hidden=256, heads=8, kv_heads=4, ffn=512, vocab=500,
                   layers=4)


@pytest.fixture(scope="module")
def single(src, tmp_path_factory):
    """Each target converted by one process (the reference trees)."""
    root = tmp_path_factory.mktemp("single")
    out = {}
    for name, args in TARGETS.items():
        kwargs = {"to": args[1], "tp": int(args[3]) if "--tp" in args else 1}
        if name == "hf":
            kwargs["max_shard_size"] = 3 * 10**6
        reshard.convert(src, str(root / name), **kwargs)
        out[name] = root / name
    return out


def _env(tag: str, dst) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", RESHARD_TEST_TAG=tag, RESHARD_DEBUG="0",
               TMPDIR=os.path.dirname(str(dst)))  # the agent's torchelastic_* folder, which torch leaves behind
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*launcher: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "reshard", "convert"]


def _two_nodes(src, dst, args, tag: str, limit_node1: int | None = None) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents, one process each, meeting at a c10d rendezvous on 127.0.0.1; node 1 optionally with
    a file size limit (its writes fail with EFBIG)."""
    port = _free_port()
    procs = []
    for node in (0, 1):
        launcher = ("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", tag, "--max-restarts", "0")

        def limit(cap=limit_node1 if node == 1 else None):
            os.setsid()
            if cap is not None:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))

        procs.append(subprocess.Popen(_torchrun(*launcher) + [str(src), str(dst), *args], env=_env(tag, dst),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      preexec_fn=limit))
    return [_finish(p) for p in procs]


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun did not finish in {TIMEOUT} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _standalone(src, dst, args, tag: str) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(_torchrun("--standalone", "--nproc-per-node", "2") + [str(src), str(dst), *args],
                            env=_env(tag, dst), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=os.setsid)
    return _finish(proc)


@pytest.fixture
def tag():
    value = f"torchrun-{uuid.uuid4().hex[:8]}"
    yield value
    assert processes_tagged(value) == [], "a process started by the test outlived it"


def assert_same_tree(got, want) -> None:
    got_files, want_files = sorted(snapshot(got)), sorted(snapshot(want))
    assert got_files == want_files
    for rel in want_files:
        if os.path.isfile(os.path.join(want, rel)):
            assert filecmp.cmp(os.path.join(got, rel), os.path.join(want, rel), shallow=False), rel


@pytest.mark.parametrize("target", targets("megatron-tp4"))
def test_standalone_two_processes_match_one(src, single, tmp_path, tag, target):
    dst = tmp_path / "out"
    run = _standalone(src, dst, TARGETS[target], tag)
    assert run.returncode == 0, run.stderr[-4000:]
    assert_same_tree(dst, single[target])
    assert leftovers(tmp_path) == []
    assert run.stdout.count(f"wrote {dst}") == 1  # rank 0 reports, once


@pytest.mark.parametrize("target", targets("vllm-tp2"))
def test_two_nodes_match_one(src, single, tmp_path, tag, target):
    dst = tmp_path / "out"
    runs = _two_nodes(src, dst, TARGETS[target], tag)
    assert [r.returncode for r in runs] == [0, 0], "\n".join(r.stderr[-3000:] for r in runs)
    assert_same_tree(dst, single[target])
    assert leftovers(tmp_path) == []


def test_one_failing_rank_fails_every_rank(src, tmp_path, tag):
    """With a file size limit below any target file on node 1 only, node 1's rank fails writing (so it was given
    files: the split is not all on rank 0): both exit non-zero, rank 0 names rank 1 and its error, nothing is
    published, the staging folder and lock are gone, the source is untouched."""
    dst = tmp_path / "out"
    before = snapshot(src)
    runs = _two_nodes(src, dst, TARGETS["megatron-tp4"], tag, limit_node1=64 << 10)
    assert all(r.returncode != 0 for r in runs), [r.returncode for r in runs]
    node0, node1 = runs[0].stderr, runs[1].stderr
    failing = [line for line in node1.splitlines() if line.startswith("[rank 1] error:")]
    assert failing and "File too large" in failing[0] and "ulimit -f" in failing[0], node1[-3000:]
    told = [line for line in node0.splitlines() if line.startswith("[rank 0] error:")]
    assert told and "rank 1 of 2 failed" in told[0] and "File too large" in told[0], node0[-3000:]
    assert "Traceback (most recent call last)" not in "".join(line for line in (node0 + node1).splitlines()
                                                              if "reshard" in line)
    assert not dst.exists()
    assert leftovers(tmp_path) == []
    assert snapshot(src) == before


def test_a_refused_request_fails_every_rank_before_writing(src, tmp_path, tag):
    """An error before any file is written (here: a bad option, found by every rank while planning) ends every
    rank with the one-line message and a non-zero exit; nothing is made."""
    dst = tmp_path / "out"
    run = _standalone(src, dst, ["--to", "megatron", "--tp", "3"], tag)
    assert run.returncode != 0
    errors = sorted(line for line in run.stderr.splitlines() if "error:" in line and line.startswith("[rank"))
    assert len(errors) == 2 and all("over tp=3" in line for line in errors), \
        run.stderr[-3000:]
    assert not dst.exists()
    assert leftovers(tmp_path) == []
