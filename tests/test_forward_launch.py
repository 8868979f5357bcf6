"""How the forward check starts its workers (issue 43): a script calling it without ``if __name__ ==
"__main__":`` runs once, its progress reaches the terminal from the workers, a worker's failure is its own one
line, and under torchrun only rank 0 prints the report."""

from __future__ import annotations

import multiprocessing
import os
import pty
import subprocess
import sys
import textwrap

import pytest

import reshard
from checkpoints import make_hf
from helpers import run_cli
from reshard.errors import ReshardError
from reshard.verification.forward.job import ForwardJob, Side
from reshard.verification.forward.launch import launch


@pytest.fixture(scope="module")
def hf_and_tp2(tmp_path_factory):
    base = tmp_path_factory.mktemp("forward_launch")
    src = make_hf(base / "hf", coded=False, seed=3, hidden=64, layers=2, heads=8, ffn=96, vocab=1000, kv_heads=2)
    reshard.convert(src, str(base / "m"), to="megatron", tp=2)
    return src, str(base / "m")


def run_on_a_terminal(args: list[str], cwd, timeout: float = 240) -> tuple[int, str, str]:
    """Run ``args`` with stderr on a pseudo-terminal (stdout a pipe): (exit code, stdout, what the terminal got)."""
    leader, follower = pty.openpty()
    here = os.path.dirname(os.path.dirname(reshard.__file__))  # the reshard this test imported
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=follower, text=True, env=env)
    os.close(follower)
    seen = bytearray()
    try:
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: every holder of the terminal has closed it
                break
            if not chunk:
                break
            seen += chunk
        out = proc.communicate(timeout=timeout)[0]
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, seen.decode(errors="replace")


def test_an_unguarded_script_runs_once_and_shows_progress(hf_and_tp2, tmp_path):
    """A plain script (no ``__main__`` guard) writes a line, then runs the check at 2 processes: the line is
    written once (no worker imports the script), the verdict is ``.equal``, and rank 0's layer progress reaches
    the terminal from its forkserver worker."""
    src, tp2 = hf_and_tp2
    log = tmp_path / "ran.log"
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent(f"""\
        import reshard
        with open({str(log)!r}, "a") as f:
            f.write("body ran\\n")
        report = reshard.verify({src!r}, {tp2!r}, forward=True, nproc=2, progress=True)
        print("VERDICT", report.equal)
        """))
    code, out, terminal = run_on_a_terminal([sys.executable, str(script)], cwd=tmp_path)
    assert code == 0, terminal[-2000:]
    assert log.read_text() == "body ran\n"
    assert out.strip() == "VERDICT True"
    assert "forward: B layer 2/2 (rank 0 of 2)" in terminal and "Traceback" not in terminal, terminal[-2000:]


class RaisesWhenUnpickled:
    """Pickles fine here; unpickling it (in a worker) raises ValueError."""

    def __reduce__(self):
        return int, ("not a number",)


def test_a_worker_that_cannot_read_its_job_reports_its_own_error(hf_and_tp2):
    src, tp2 = hf_and_tp2
    job = ForwardJob(a=Side(src, "hf", 1), b=Side(tp2, "megatron", 2), input_ids=[[1, 2, 3]], vocab=1000, timeout=60)
    job.a.run = RaisesWhenUnpickled()
    with pytest.raises(ReshardError) as info:
        launch(job)
    message = str(info.value)
    assert message.startswith("forward check failed on rank ") and "\n" not in message, message
    assert message.endswith("ValueError: invalid literal for int() with base 10: 'not a number'"), message
    assert not multiprocessing.active_children()


def test_a_dead_worker_is_named_with_how_it_ended():
    from reshard.verification.forward.launch import _death

    assert _death(1) == "exited with code 1"
    assert _death(-9) == "was killed by SIGKILL (out of memory?)"
    assert _death(-15) == "was killed by SIGTERM"


@pytest.fixture(scope="module")
def tp2_report(hf_and_tp2):
    return reshard.verify(*hf_and_tp2, forward=True)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_under_torchrun_only_rank_0_prints_the_report(hf_and_tp2, tp2_report, capsys, monkeypatch, rank):
    """Every rank of a torchrun world gets rank 0's report (here: a real one, returned by a stand-in launcher);
    rank 0 alone prints it, and every rank exits with the verdict's code."""
    src, tp2 = hf_and_tp2
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr("reshard.verification.forward.launch", lambda job: dict(tp2_report.report))
    code, out, err = run_cli(capsys, "verify", "--forward", src, tp2)
    assert code == 0, err
    assert ("FORWARD EQUAL" in out) == (rank == "0") and (out == "") == (rank == "1"), out
    code, out, err = run_cli(capsys, "verify", "--forward", src, tp2, "--json")
    assert code == 0 and (out == "") == (rank == "1"), err
