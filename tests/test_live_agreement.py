"""reshard.live's plan agreement (issue 42, item 2): ranks that planned different transfers raise the same
``TransferError`` before any byte moves, naming two ranks and the first difference; a rank that never calls
``transfer`` is named at the transfer's timeout. The summary and verdict functions are tested directly, the
exchange with threads on one in-process store, and whole gloo worlds on 127.0.0.1 (one per case, all at once):
another ``intermediate_size``, another vocab, other degrees (same ranks, and other ranks: two transfers waiting
for each other), a rank that never joins. Every process exits by itself (no signal) and none posts a
point-to-point operation.

Run as a script it is the launcher of those worlds: ``python test_live_agreement.py TMP WAIT`` (see :func:`main`)."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from checkpoints import hf_config
from helpers import free_port
from reshard import live
from reshard.live import agree as agreement
from reshard.live.compare import (apart, config_items, difference, message, pick, section_tensors, spec_label,
                                  summary, tensor_difference)
from reshard.live.schedule import build
from reshard.live.watch import TransferError, Watch

SOURCE, TARGET = {"layout": "megatron", "tp": 2}, {"layout": "vllm", "tp": 1}
CONFIG = hf_config(kv_heads=4)
FIX = "(plan each rank from the same checkpoint config and degrees)"


def plan_of(config=CONFIG, source=SOURCE, target=TARGET, source_ranks=(0, 1), target_ranks=(2,)):
    return live.plan(config, source=source, target=target, source_ranks=source_ranks, target_ranks=target_ranks)


def summary_of(plan, dtype=None, chunk=1 << 20) -> dict:
    return summary(plan, dtype, chunk, build(plan, dtype, chunk))


# --- the summary and the verdict, as functions --------------------------------------------------------------------

def test_equal_plans_have_equal_digests_and_a_small_summary():
    a, b = summary_of(plan_of()), summary_of(plan_of(source={"layout": "megatron", "tp": 2, "pp": 1}))
    assert a == b and len(a["digest"]) == 16
    assert len(json.dumps(a)) < 1000
    assert a["items"][:2] == [["source", "megatron tp2"], ["target", "vllm"]]
    assert [k for k, _ in a["sections"]] == ["source 0", "source 1", "target 0"]
    assert config_items(plan_of().meaning)["ffn"] == 96 and "norm_eps" not in config_items(plan_of().meaning)
    assert spec_label({"layout": "vllm", "tp": 2, "expert_parallel": True, "dtype": "bf16"}, "target") == \
        "vllm tp2 expert_parallel dtype=BF16"
    assert spec_label({"layout": "megatron", "tp": 2, "mapping": "/a/m.toml"}, "source") == "megatron tp2"  # a path
    assert summary_of(plan_of(), chunk=4096)["digest"] != a["digest"]
    assert summary_of(plan_of(), dtype="BF16")["digest"] != a["digest"]


def test_difference_names_the_first_differing_item_in_order():
    base = summary_of(plan_of())
    ffn = summary_of(plan_of(config=hf_config(kv_heads=4, ffn=98)))
    assert difference(base, ffn, 0, 2) == (
        "the config's ffn (intermediate_size) is 96 on rank 0 and 98 on rank 2", None, FIX[1:-1])
    vocab = summary_of(plan_of(config=hf_config(kv_heads=4, vocab=1024)))
    assert difference(vocab, base, 1, 3).text == "the config's vocab (vocab_size) is 1024 on rank 1 and 1000 on rank 3"
    tp2 = summary_of(plan_of(target={"layout": "vllm", "tp": 2}, target_ranks=(2, 3)))
    assert difference(base, tp2, 0, 3).text == "the target is vllm on rank 0 and vllm tp2 on rank 3"
    ranks = summary_of(plan_of(target_ranks=(3,)))
    assert difference(base, ranks, 0, 1).text == "target_ranks is [2] on rank 0 and [3] on rank 1"
    chunk = difference(base, summary_of(plan_of(), chunk=4096), 0, 1)
    assert chunk.text == "chunk_bytes is 1048576 on rank 0 and 4096 on rank 1"
    assert chunk.fix == "pass the same dtype and chunk_bytes to live.transfer on every rank"
    assert difference(base, summary_of(plan_of(), dtype="BF16"), 0, 1).text == \
        "the transfer's dtype is None (the plan's) on rank 0 and BF16 on rank 1"
    # the config means the same, the tensors differ (another torch_dtype): the tensor list names it
    bf16 = plan_of(config=dict(CONFIG, torch_dtype="bfloat16"))
    found = difference(base, summary_of(bf16), 0, 1)
    assert found.text is None and found.section == "source 0"
    assert tensor_difference(found.section, section_tensors(plan_of(), "source 0"),
                             section_tensors(bf16, "source 0"), 0, 1) == \
        "source tensor 'embedding.word_embeddings.weight' is [512, 64] fp32 on rank 0 and [512, 64] bf16 on rank 1"
    other = dict(base, schedule="0" * 16, version="9.9")
    assert difference(base, other, 0, 1) == ("the same plan gives different message schedules on ranks 0 and 1 "
                                             f"(reshard {base['version']} and 9.9)", None,
                                             "run the same reshard version on every rank")


def test_tensor_difference_names_shapes_missing_and_reordered_tensors():
    a = [["x", [4, 2], "BF16"], ["y", [2], "F32"]]
    assert tensor_difference("target 1", a, [["x", [6, 2], "BF16"], ["y", [2], "F32"]], 0, 2) == \
        "target tensor 'x' is [4, 2] bf16 on rank 0 and [6, 2] bf16 on rank 2"
    assert tensor_difference("target 1", a, a[:1], 0, 2) == \
        "target tensor 'y' (parallel rank 1) is planned on rank 0 but not on rank 2"
    assert tensor_difference("source 0", a[:1] + [["z", [2], "F32"]], a, 0, 2) == \
        "source tensor 'z' (parallel rank 0) is planned on rank 0 but not on rank 2"
    assert tensor_difference("source 0", a, a[::-1], 0, 2) == \
        "source parallel rank 0 lists 'x' on rank 0 where rank 2 lists 'y'"


def test_pick_and_message_name_the_majority_rank_and_the_odd_ones():
    recs = [{"rank": r, "plan": d} for r, d in enumerate("aaba")]
    assert pick(recs) == (0, 2, [2])
    assert pick([{"rank": r, "plan": "a"} for r in range(3)]) is None
    assert pick([{"rank": r, "plan": d} for r, d in enumerate("abbb")]) == (1, 0, [0])
    assert pick([{"rank": r, "plan": d} for r, d in enumerate("abcb")]) == (1, 0, [0, 2])
    assert message(0, 2, "x differs", "fix it") == "live.transfer: ranks 0 and 2 planned different transfers: " \
        "x differs (fix it)"
    assert message(1, 0, "t", "f", [0, 2, 3]) == "live.transfer: ranks 0 and 1 planned different transfers: t; " \
        "the plans of ranks 2 and 3 differ from rank 1's too (f)"
    same = summary_of(plan_of())
    assert apart({2: same, 0: same}, {2: 1, 0: 2}) == (
        "live.transfer: ranks 0 and 2 are in different transfers between the same ranks (call 2 on rank 0, call 1 "
        "on rank 2): call live.transfer on every participant for every plan, in the same order")
    tp2 = summary_of(plan_of(target={"layout": "vllm", "tp": 2}, target_ranks=(2, 3)))
    assert apart({2: same, 0: tp2}, {2: 1, 0: 1}) == (
        f"live.transfer: ranks 0 and 2 planned different transfers: the target is vllm tp2 on rank 0 and vllm on "
        f"rank 2 {FIX}")


# --- the exchange, with threads on one store ----------------------------------------------------------------------

def exchange(plans: dict, timeout: float = 10.0, absent=()) -> dict:
    """Run the agreement step of ``plans`` (rank -> plan) in one thread per rank on a HashStore; rank -> the
    error it raised (None: it went on) and its seconds. Ranks in ``absent`` never come."""
    import torch.distributed as dist

    store, out = dist.HashStore(), {}
    participants = sorted(plans)

    def run(rank):
        watch = Watch(store, participants, rank, timeout, label=f"t{id(out)}-")
        watch.prefix, watch.call = f"reshard_live/t{id(out)}/0/", 0
        started = time.monotonic()
        try:
            plan = plans[rank]
            agreement.publish(watch, summary_of(plan))
            records = agreement.agree(watch, {"rank": rank, "plan": summary_of(plan)["digest"]})
            agreement.check_plans(watch, records, lambda key: section_tensors(plan, key))
            out[rank] = (None, time.monotonic() - started)
        except TransferError as exc:
            watch.fail(exc)
            out[rank] = (str(exc), time.monotonic() - started)

    threads = [threading.Thread(target=run, args=(r,)) for r in participants if r not in absent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return out


def test_the_exchange_passes_equal_plans_and_names_a_differing_tensor_on_every_rank():
    assert exchange({r: plan_of() for r in range(3)}) == {r: (None, pytest.approx(0, abs=2)) for r in range(3)}
    odd = plan_of(config=dict(CONFIG, torch_dtype="bfloat16"))  # same meaning, bf16 tensors: the second exchange
    out = exchange({0: plan_of(), 1: odd, 2: plan_of()})
    want = ("live.transfer: ranks 0 and 1 planned different transfers: source tensor "
            "'embedding.word_embeddings.weight' is [512, 64] fp32 on rank 0 and [512, 64] bf16 on rank 1 " + FIX)
    assert {r: e for r, (e, _) in out.items()} == {0: want, 1: want, 2: want}
    assert all(s < 2 for _, s in out.values())


def test_the_exchange_names_a_rank_that_never_comes_at_the_deadline():
    out = exchange({r: plan_of() for r in range(3)}, timeout=1.0, absent=(2,))
    for rank in (0, 1):
        error, seconds = out[rank]
        assert error.endswith("live.transfer: rank 2 never joined the transfer within 1 s (call live.transfer "
                              "with the same plan on every rank of its source_ranks and target_ranks)"), error
        assert seconds < 2.0
        if "on another rank" not in error:
            assert seconds >= 1.0  # its own deadline (the other rank may hear of the first one's)


# --- gloo worlds --------------------------------------------------------------------------------------------------

def worlds(tmp_path, cases: dict, wait: float) -> dict:
    """Run every case of ``cases`` (name -> (world size, plan, per-rank changes, absent rank)) in a gloo world of
    its own, all at once, from one launcher process of this file that imports torch once and forks the ranks;
    name -> (results per rank, exit codes). Every process is gone at the end: the launcher kills a rank still
    alive after ``wait`` seconds (and the test kills the launcher's process group if it outlives that)."""
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    launcher = subprocess.Popen([sys.executable, __file__, str(tmp_path), str(wait)], env=env, start_new_session=True)
    try:
        launcher.wait(timeout=wait + 30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the launcher still runs after {wait + 30} s")
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 0
    codes = json.loads((tmp_path / "codes.json").read_text())
    out = {}
    for name, exits in codes.items():
        results = [json.loads(f.read_text()) if (f := tmp_path / name / f"{r}.json").exists() else None
                   for r in range(len(exits))]
        out[name] = results, exits
    return out


TP = {"layout": "vllm", "tp": 2}
CASES = {  # world size, what every rank plans, what some ranks plan instead, the rank that never calls transfer
    "ffn": (3, {}, {2: {"config": dict(CONFIG, intermediate_size=98)}}, None),
    "vocab": (3, {}, {2: {"config": dict(CONFIG, vocab_size=1024)}}, None),
    "degrees": (4, {"target": TP, "target_ranks": [2, 3]},
                {3: {"target": {"layout": "vllm", "tp": 4}, "target_ranks": [0, 1, 2, 3]}}, None),
    "other-ranks": (3, {}, {2: {"source": {"layout": "megatron", "tp": 1}, "source_ranks": [0]}}, None),
    "absent": (3, {"timeout": 4.0}, {}, 2),
}


def test_disagreeing_ranks_raise_before_any_byte_moves(tmp_path):
    done = worlds(tmp_path, CASES, wait=90.0)
    assert sorted(done) == sorted(CASES)
    for name, (results, codes) in done.items():
        assert codes == [0] * len(codes), (name, codes)  # no SIGABRT in gloo, nobody killed
        for r, res in enumerate(results):
            assert res is not None and res["p2p"] == 0, (name, r, res)  # not one point-to-point operation

    def errors(name):
        return [res["error"] for res in done[name][0]]

    ffn = ("TransferError: live.transfer: ranks 0 and 2 planned different transfers: the config's ffn "
           f"(intermediate_size) is 96 on rank 0 and 98 on rank 2 {FIX}")
    assert errors("ffn") == [ffn] * 3
    vocab = ffn.replace("ffn (intermediate_size) is 96 on rank 0 and 98", "vocab (vocab_size) is 1000 on rank 0 "
                        "and 1024")
    assert errors("vocab") == [vocab] * 3
    degrees = ("TransferError: live.transfer: ranks 0 and 3 planned different transfers: the target is vllm tp2 on "
               f"rank 0 and vllm tp4 on rank 3 {FIX}")
    assert errors("degrees") == [degrees] * 4
    # rank 2 plans a transfer between ranks 0 and 2, the others between 0, 1 and 2: the two transfers wait for each
    # other, every rank sees it (or hears it from another rank first)
    apart_ = ("live.transfer: ranks 0 and 2 planned different transfers: the source is megatron tp2 on rank 0 and "
              f"megatron on rank 2 {FIX}")
    for r, error in enumerate(errors("other-ranks")):
        assert error.startswith("TransferError: ") and error.endswith(apart_), (r, error)
        assert error.count("TransferError") <= 2, (r, error)
    for name in ("ffn", "vocab", "degrees", "other-ranks"):
        for r, res in enumerate(done[name][0]):
            assert res["seconds"] < 30, (name, r, res["seconds"])
    absent = done["absent"][0]
    assert absent[2] == {"absent": True, "p2p": 0}
    for res in absent[:2]:
        assert res["error"].startswith("TransferError: ") and res["error"].endswith(
            "live.transfer: rank 2 never joined the transfer within 4 s (call live.transfer with the same plan on "
            "every rank of its source_ranks and target_ranks)"), res  # its own deadline, or the first rank's
        assert res["seconds"] < 4.0 + 5, res
        if "on another rank" not in res["error"]:
            assert res["seconds"] >= 4.0, res  # the transfer's own deadline, not before


# --- the launcher and its ranks ------------------------------------------------------------------------------------

def run(case: dict, rank: int) -> dict:
    """This rank's part of ``case``: plan (the case's plan, this rank's changes applied), spy on point-to-point
    operations, transfer zeros of the planned shapes; or sleep past the others' timeout when absent."""
    import torch
    import torch.distributed as dist

    from reshard.io import dtypes

    world, changes, every, absent = case
    spec = {"config": CONFIG, "source": SOURCE, "target": TARGET, "source_ranks": [0, 1], "target_ranks": [2],
            "timeout": 60.0}
    spec.update(changes)
    spec.update(every.get(str(rank), {}))
    posted = [0]
    for name in ("P2POp", "batch_isend_irecv", "send", "recv"):  # isend / irecv only reach gloo inside these
        real = getattr(dist, name)

        def spy(*args, _real=real, **kwargs):
            posted[0] += 1
            return _real(*args, **kwargs)
        setattr(dist, name, spy)
    if absent == rank:
        time.sleep(spec["timeout"] + 2)
        return {"absent": True, "p2p": posted[0]}
    plan = live.plan(spec["config"], source=spec["source"], target=spec["target"], source_ranks=spec["source_ranks"],
                     target_ranks=spec["target_ranks"])
    local = None
    if rank in plan.source_ranks:
        held = plan.sources[plan.source_ranks.index(rank)]
        local = {n: torch.zeros(t.shape, dtype=dtypes.to_torch(t.dtype)) for n, t in held.items()}
    started = time.monotonic()
    try:
        live.transfer(plan, local, timeout=spec["timeout"])
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.monotonic() - started, "p2p": posted[0]}


def rank_main(case: list, rank: int, port: int, out: str) -> None:
    """One forked rank: join its world, run its part, write OUT/RANK.json, leave with the others."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=case[0],
                            timeout=datetime.timedelta(seconds=60))
    result = run(case, rank)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()  # no point-to-point operation was posted: the group still works; rank 0 hosts the store
    dist.destroy_process_group()


def _child(case: list, rank: int, port: int, out: str) -> None:
    try:
        rank_main(case, rank, port, out)
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def main() -> None:
    """The launcher: ``python test_live_agreement.py TMP WAIT`` forks every rank of every case of TMP/cases.json
    (torch imported once), waits at most WAIT seconds, kills what is left and writes TMP/codes.json."""
    import multiprocessing

    import torch.distributed  # noqa: F401  (imported once, before the forks)

    root, wait = sys.argv[1], float(sys.argv[2])
    with open(os.path.join(root, "cases.json")) as f:
        cases = json.load(f)
    live.plan(CONFIG, source=SOURCE, target=TARGET, source_ranks=[0, 1], target_ranks=[2])  # mappings read once
    fork = multiprocessing.get_context("fork")
    procs = {}
    for name, case in cases.items():
        out, port = os.path.join(root, name), free_port()
        os.makedirs(out)
        procs[name] = [fork.Process(target=_child, args=(case, r, port, out)) for r in range(case[0])]
        for p in procs[name]:
            p.start()
    deadline = time.monotonic() + wait
    for p in (p for ps in procs.values() for p in ps):
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    with open(os.path.join(root, "codes.json"), "w") as f:
        json.dump({name: [p.exitcode for p in ps] for name, ps in procs.items()}, f)


if __name__ == "__main__":
    main()
