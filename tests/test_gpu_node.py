"""A GPU node with fewer GPUs than processes: the demo and the forward check fall back to gloo on CPU with a note;
an explicit ``--backend nccl`` that cannot give every process a GPU is refused before any process starts (exit 2).
No GPU is needed: torch's CUDA device count is faked."""

from __future__ import annotations

import pytest
import torch

from cli_inprocess import run_main
from reshard.demo import make_demo_checkpoint
from reshard.errors import ReshardError
from reshard.verification.forward import backend as backend_mod
from reshard.verification.forward.backend import choose_backend


def fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("gpus, nproc, want", [(0, 1, "gloo"), (0, 8, "gloo"), (1, 1, "nccl"), (1, 2, "gloo"),
                                               (2, 2, "nccl"), (8, 2, "nccl"), (4, 8, "gloo")])
def test_automatic_choice_needs_a_gpu_per_process(monkeypatch, no_torchrun, gpus, nproc, want):
    fake_gpus(monkeypatch, gpus)
    chosen, note = choose_backend(None, nproc)
    assert chosen == want
    if gpus and want == "gloo":  # GPUs there but too few: say why they are not used
        assert note.startswith("backend gloo on CPU") and f"{nproc} processes" in note
        assert f"{gpus} GPU{'s' if gpus > 1 else ''} visible" in note and "one GPU per process" in note
    else:
        assert note is None


def test_torchrun_counts_the_processes_of_this_node(monkeypatch, no_torchrun):
    fake_gpus(monkeypatch, 4)
    monkeypatch.setenv("WORLD_SIZE", "8")  # two nodes of 4 processes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert choose_backend(None, 8, torchrun=True) == ("nccl", None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "5")
    chosen, note = choose_backend(None, 8, torchrun=True)
    assert chosen == "gloo" and "8 processes" in note and "4 GPUs visible" in note


def test_nccl_refusal_names_the_gpu_count_and_the_ways_out(monkeypatch, no_torchrun):
    fake_gpus(monkeypatch, 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ReshardError) as err:
        choose_backend("nccl", 2)
    message = str(err.value)
    assert err.value.exit_code == 2 and "\n" not in message
    assert "1 GPU visible (CUDA_VISIBLE_DEVICES=3)" in message and "2 processes" in message
    assert "--backend gloo" in message and "--nproc 1" in message
    with pytest.raises(ReshardError) as err:
        choose_backend("nccl", 2, fixed_nproc=True)  # B's rank files fix the count: convert instead
    assert "convert B to tp=1 first" in str(err.value)
    fake_gpus(monkeypatch, 0)
    with pytest.raises(ReshardError, match=r"0 GPUs\); use --backend gloo"):
        choose_backend("nccl", 1)
    assert choose_backend("gloo", 2) == ("gloo", None)
    with pytest.raises(ReshardError, match="unknown --backend 'mpi'"):
        choose_backend("mpi", 2)


def test_a_driver_that_fails_counts_as_no_gpu(monkeypatch, no_torchrun):
    def broken():
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", broken)
    assert backend_mod.visible_gpus() == 0
    assert choose_backend(None, 2) == ("gloo", None)


@pytest.fixture(scope="module")
def hf_and_tp2(tmp_path_factory):
    from reshard import convert

    base = tmp_path_factory.mktemp("gpu-node")
    src = make_demo_checkpoint(str(base / "hf"))
    dst = str(base / "meg-tp2")
    convert(src, dst, to="megatron", tp=2)
    return src, dst


def test_one_gpu_forward_of_tp2_runs_on_gloo_with_the_note(monkeypatch, no_torchrun, hf_and_tp2):
    src, dst = hf_and_tp2
    fake_gpus(monkeypatch, 1)
    proc = run_main("verify", "--forward", src, dst)
    assert proc.returncode == 0, proc.stderr
    assert ", gloo, compute float32" in proc.stdout and "FORWARD EQUAL" in proc.stdout
    assert "note: backend gloo on CPU: this node runs 2 processes and has 1 GPU visible" in proc.stdout
    header = proc.stdout.splitlines()[:4]  # both sides with their degrees, how A runs, no nested parentheses
    assert header[0].startswith("A hf tp=1 pp=1 float32 ") and header[1].startswith("  A runs sliced at tp=2")
    assert header[2].startswith("B megatron tp=2 pp=1 float32 ")
    for line in proc.stdout.splitlines():
        depth = 0
        for c in line:
            depth += {"(": 1, ")": -1}.get(c, 0)
            assert depth <= 1, line


def test_one_gpu_nccl_is_refused_before_any_process_starts(monkeypatch, no_torchrun, hf_and_tp2):
    src, dst = hf_and_tp2
    fake_gpus(monkeypatch, 1)

    def no_launch(job):
        raise AssertionError("a process was started")

    monkeypatch.setattr("reshard.verification.forward.launch", no_launch)
    proc = run_main("verify", "--forward", src, dst, "--backend", "nccl")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--backend nccl needs one GPU per process" in lines[0]
    assert "1 GPU visible" in lines[0] and "convert B to tp=1 first" in lines[0]


def test_demo_passes_on_a_one_gpu_machine(monkeypatch, no_torchrun, tmp_path):
    """The whole demo, for real (the suite's one run of it), where torch sees one GPU."""
    fake_gpus(monkeypatch, 1)
    proc = run_main("demo", "--workdir", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "demo passed" in proc.stdout and proc.stdout.count("tensors bit-exact") == 5
    assert "forward check: hf-roundtrip at tp=2 (gloo) vs source at tp=1" in proc.stdout
    assert "equal within float32 tolerance" in proc.stdout
    for step in ("megatron-tp4", "vllm-tp8", "megatron-tp2-pp2", "torch-dist", "hf-roundtrip"):
        assert (tmp_path / step).is_dir()


def test_demo_on_cpu_whatever_gpus_there_are(monkeypatch, no_torchrun, tmp_path):
    """8 GPUs (busy or not): the demo asks for gloo unless told otherwise; --backend auto chooses."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    fake_gpus(monkeypatch, 8)
    asked = []
    monkeypatch.setattr("reshard.demo._run_steps", lambda base, backend: asked.append(backend) or True)
    assert run_main("demo").returncode == 0
    assert run_main("demo", "--backend", "auto").returncode == 0
    assert asked == ["gloo", None]
