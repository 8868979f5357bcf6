"""reshard.live's NCCL device rules, without a GPU: the verdict of the agreement step as a pure function of the
records, the records' GPU identity and tensor checks with ``torch.cuda`` faked, and a real gloo world of 3
processes on 127.0.0.1 whose backend and GPUs are faked: two ranks on one GPU, or a rank's ``into=`` tensors on
another device than ``device=``, make every rank raise the same ``TransferError`` before any round (no
``batch_isend_irecv``, no source tensor looked up, ``into`` untouched); distinct GPUs pass the agreement and the
transfer equals ``load_rank`` bit for bit; a gloo group skips the step.

Run as a script it is one process of that world: ``python test_live_devices.py JOB.json RANK WORLD PORT OUT``."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import types
from collections.abc import Mapping

import pytest
import torch

from checkpoints import hf_config, make_hf
from helpers import run_world
from reshard import live
from reshard.live import agree as agreement
from reshard.live.agree import gpu_identity, gpu_key, tensor_problems, uses_nccl, verdict
from reshard.live.transfer import _Local

HOST = socket.gethostname()
UUID = "fa{:06x}-0000-4000-8000-0000000000{:02x}"  # the faked GPU of CUDA index i: UUID.format(i, i)
SOURCE, TARGET = {"layout": "megatron", "tp": 2}, {"layout": "vllm", "tp": 1}


def record(rank, index, host="h", nccl=True, problems=(), device=None, uuid=True) -> dict:
    gpu = {"host": host, "index": index, "uuid": f"GPU-{index}" if uuid else None, "pci": f"0000:{index:02x}:00"}
    return {"rank": rank, "backend": "nccl", "nccl": nccl, "device": device or f"cuda:{index}", "gpu": gpu,
            "problems": list(problems)}


def test_verdict_passes_distinct_gpus_and_gpu_zero_on_two_hosts():
    assert verdict([record(0, 0), record(1, 1), record(2, 2)]) is None
    assert verdict([record(0, 0, host="a"), record(1, 0, host="b")]) is None
    assert verdict([record(0, 0, nccl=False), record(1, 0, nccl=False)]) is None  # gloo moves them: no rule
    assert verdict([record(0, 0)]) is None


def test_verdict_names_the_ranks_sharing_a_gpu_its_device_and_the_fix():
    assert verdict([record(0, 0), record(1, 0), record(2, 1)]) == (
        "live.transfer: ranks 0 and 1 share GPU cuda:0 (GPU-0) on host h; NCCL needs one GPU per rank: give each "
        "rank its own device (torch.cuda.set_device(local_rank)), or use a gloo group")
    three = verdict([record(0, 3), record(1, 3), record(2, 3)])
    assert three.startswith("live.transfer: ranks 0, 1 and 2 share GPU cuda:3 (GPU-3) on host h;")
    # one physical GPU seen under two indices (CUDA_VISIBLE_DEVICES differs): the UUID decides
    a, b = record(0, 0), record(1, 1)
    b["gpu"]["uuid"] = a["gpu"]["uuid"]
    assert verdict([a, b]).startswith("live.transfer: ranks 0 (cuda:0) and 1 (cuda:1) share one GPU (GPU-0) on "
                                      "host h;")


def test_verdict_without_uuid_falls_back_to_pci_then_index():
    a, b = record(0, 0, uuid=False), record(1, 0, uuid=False)
    assert verdict([a, b]).startswith("live.transfer: ranks 0 and 1 share GPU cuda:0 (PCI 0000:00:00) on host h;")
    a["gpu"]["pci"] = b["gpu"]["pci"] = None
    assert gpu_key(a["gpu"]) == "h/cuda:0"
    assert verdict([a, b]).startswith("live.transfer: ranks 0 and 1 share GPU cuda:0 on host h;")


def test_verdict_lists_every_rank_s_problems_then_the_sharing():
    records = [record(0, 0, problems=["rank 0: x is wrong"]), record(1, 0), record(2, 2, problems=["rank 2: y"])]
    found = verdict(records)
    assert found == ("live.transfer: rank 0: x is wrong; rank 2: y; ranks 0 and 1 share GPU cuda:0 (GPU-0) "
                     "on host h; NCCL needs one GPU per rank: give each rank its own device "
                     "(torch.cuda.set_device(local_rank)), or use a gloo group")
    many = verdict([record(r, r, problems=[f"rank {r}: bad"]) for r in range(6)])
    assert many == "live.transfer: rank 0: bad; rank 1: bad; rank 2: bad; rank 3: bad; and 2 more"


def test_tensor_problems_name_rank_tensor_and_both_devices():
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert tensor_problems(3, [("into['a']", cuda0)], cuda0) == []
    assert tensor_problems(3, [("into['a']", cuda1)], cuda0) == [
        "rank 3: into['a'] is on cuda:1, not the transfer's device cuda:0: move it to cuda:0, or make cuda:1 the "
        "transfer's device (device='cuda:1', or torch.cuda.set_device(1) before the transfer)"]
    cpu = torch.device("cpu")
    assert tensor_problems(1, [("into['a']", cpu), ("into['b']", cuda0), ("into['c']", cpu)], cuda0) == [
        "rank 1: into['a'] (and 1 more) are on cpu, but NCCL moves CUDA tensors only: move them to cuda:0 (the "
        "transfer's device), or use a gloo group"]


def test_uses_nccl_reads_single_and_per_device_backends():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert uses_nccl("nccl", cuda) and uses_nccl("NCCL", cpu)
    assert not uses_nccl("gloo", cuda)
    assert uses_nccl("cpu:gloo,cuda:nccl", cuda) and not uses_nccl("cpu:gloo,cuda:nccl", cpu)


class FakeCuda:
    """``torch.cuda`` as a machine with ``count`` GPUs whose current one is ``current`` (GPU i: UUID.format(i, i),
    PCI bus 0x10 + i)."""

    def __init__(self, current: int, count: int = 3):
        self.current, self.count = current, count

    def props(self, index):
        assert 0 <= index < self.count
        return types.SimpleNamespace(name="Fake", uuid=UUID.format(index, index), pci_bus_id=0x10 + index,
                                     pci_device_id=0, pci_domain_id=0)

    def patches(self) -> dict:
        return {"is_available": lambda: True, "device_count": lambda: self.count,
                "current_device": lambda: self.current, "get_device_properties": self.props}


def test_gpu_identity_reads_uuid_pci_and_host(monkeypatch):
    for name, fn in FakeCuda(current=2).patches().items():
        monkeypatch.setattr(torch.cuda, name, fn)
    assert gpu_identity(torch.device("cuda", 1)) == {"host": HOST, "index": 1, "uuid": "GPU-" + UUID.format(1, 1),
                                                     "pci": "0000:11:00"}
    assert gpu_identity(torch.device("cpu"))["index"] == 2  # NCCL's GPU is the current one
    assert agreement.resolve("cuda") == torch.device("cuda", 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_identity(torch.device("cuda", 1)) is None


def test_a_lazy_source_tensor_is_checked_on_first_use():
    plan = live.plan(hf_config(kv_heads=4), source=SOURCE, target=TARGET, source_ranks=[4, 5], target_ranks=[6])
    name, want = next(iter(plan.sources[1].items()))
    tensor = torch.zeros(want.shape)
    with pytest.raises(live.TransferError) as err:
        _Local(plan, 1, {name: tensor}, [], torch.device("cuda", 1))[name]
    assert str(err.value) == (f"live.transfer: rank 5: local_tensors['{name}'] is on cpu, but NCCL moves CUDA "
                              "tensors only: move it to cuda:1 (the transfer's device), or use a gloo group")
    assert _Local(plan, 1, {name: tensor}, [], None)[name] is tensor  # no rule (gloo)
    assert _Local(plan, 1, {name: tensor}, [], torch.device("cpu"))[name] is tensor


# --- the 3-process world ------------------------------------------------------------------------------------------

def launch(tmp_path, world: int, job: dict, wait: float = 120.0) -> tuple[list[dict], list[int]]:
    """Run ``job`` on ``world`` processes of this file; (results per rank by case name, return codes). Every
    process is gone at the end: one still alive after ``wait`` seconds is killed with its process group."""
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    return run_world(__file__, path, world, tmp_path, wait)


CASES = [
    # ranks 0 and 1 on GPU 0, rank 2 on GPU 1; sources lazy, the target allocates (never reached)
    {"name": "shared", "gpus": [0, 0, 1], "backend": "nccl", "local": "lazy"},
    # distinct GPUs; rank 0's dict and rank 2's into= hold CPU tensors, rank 1's lazy mapping is not looked at
    {"name": "into", "gpus": [0, 1, 2], "backend": "nccl", "local": ["dict", "lazy"], "into": True},
    # distinct GPUs, the bytes moved by gloo on CPU (device cpu): the agreement runs and passes
    {"name": "distinct", "gpus": [0, 1, 2], "backend": "nccl", "device": "cpu", "local": "dict", "into": True},
    {"name": "gloo", "local": "dict", "into": True},  # no fakes: the plain gloo path, no agreement
]


def test_device_rules_on_a_faked_nccl_world(tmp_path):
    ckpt = make_hf(tmp_path / "llama", kv_heads=4)
    results, codes = launch(tmp_path, 3, {"ckpt": ckpt, "cases": CASES})
    assert codes == [0, 0, 0]

    shared = [results[r]["shared"] for r in range(3)]
    assert shared[0]["error"] == (
        f"TransferError: live.transfer: ranks 0 and 1 share GPU cuda:0 (GPU-{UUID.format(0, 0)}) on host {HOST}; "
        "NCCL needs one GPU per rank: give each rank its own device (torch.cuda.set_device(local_rank)), or use a "
        "gloo group")
    for res in shared:
        assert res["error"] == shared[0]["error"], res
        assert res["batches"] == 0 and res["lookups"] == 0, res

    into = [results[r]["into"] for r in range(3)]
    message = into[0]["error"]
    assert message.startswith("TransferError: live.transfer: rank 0: local_tensors['") and "rank 1" not in message
    assert "are on cpu, but NCCL moves CUDA tensors only: move them to cuda:0 (the transfer's device)" in message
    assert "; rank 2: into['" in message and "are on cpu, but NCCL moves CUDA tensors only: move them to cuda:2" in \
        message
    for res in into:
        assert res["error"] == message, res
        assert res["batches"] == 0 and res["lookups"] == 0, res
    assert into[2]["into_untouched"] is True

    for name in ("distinct", "gloo"):
        for rank, res in enumerate(results[r][name] for r in range(3)):
            assert res["error"] is None, (name, rank, res["error"])
            assert res["batches"] > 0, (name, rank)
        target = results[2][name]
        assert target["names_equal"] and target["mismatch"] == [] and target["in_place"], target
    records = [results[r]["distinct"]["records"] for r in range(3)]
    assert records[0] == records[1] == records[2]
    assert [(r["rank"], r["nccl"], r["gpu"]["uuid"]) for r in records[0]] == [
        (i, True, "GPU-" + UUID.format(i, i)) for i in range(3)]
    # gloo: the plan agreement runs too, with no GPU rules
    assert [(r["rank"], r["nccl"], r["gpu"]) for r in results[0]["gloo"]["records"]] == [(i, False, None) for i in range(3)]


# --- the worker ---------------------------------------------------------------------------------------------------

class Lazy(Mapping):
    """``tensors`` looked up on demand, counting look-ups."""

    def __init__(self, tensors: dict):
        self.tensors, self.count = tensors, 0

    def __getitem__(self, name):
        self.count += 1
        return self.tensors[name]

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)


@contextlib.contextmanager
def faked(case: dict, rank: int, spies: dict):
    """``case``'s backend and GPUs on this rank (none for a case without ``backend``), and spies counting
    ``batch_isend_irecv`` calls and catching the agreement's records."""
    import importlib

    import torch.distributed as dist

    T = importlib.import_module("reshard.live.transfer")  # the module (reshard.live.transfer is the function)
    saved = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    batch, agree = dist.batch_isend_irecv, T.agree

    def counted(ops):
        spies["batches"] += 1
        return batch(ops)

    def caught(watch, rec):
        spies["records"] = agree(watch, rec)
        return spies["records"]

    patch(dist, "batch_isend_irecv", counted)
    patch(T, "agree", caught)
    if case.get("backend"):
        for name, fn in FakeCuda(case["gpus"][rank]).patches().items():
            patch(torch.cuda, name, fn)
        patch(dist, "get_backend", lambda group=None: case["backend"])
        if case.get("device"):
            patch(T, "_default_device", lambda group: case["device"])
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def run_case(case: dict, ckpt: str, rank: int) -> dict:
    import reshard
    from live_worker import rank_kwargs
    from reshard.io.assemble import bits_equal

    plan = live.plan(ckpt, source=SOURCE, target=TARGET, source_ranks=[0, 1], target_ranks=[2])
    result, spies = {"name": case["name"], "rank": rank}, {"batches": 0, "records": None}
    local = into = None
    if rank < 2:
        local = reshard.load_rank(ckpt, to="megatron", **rank_kwargs(SOURCE, rank))
        kind = case["local"] if isinstance(case["local"], str) else case["local"][rank]
        local = Lazy(local) if kind == "lazy" else local
    else:
        want = reshard.load_rank(ckpt, to="vllm")
        if case.get("into"):
            into = {n: torch.full_like(t, float("nan")) for n, t in want.items()}
            ptrs = {n: t.data_ptr() for n, t in into.items()}
    try:
        with faked(case, rank, spies):
            got = live.transfer(plan, local, into=into, timeout=30)
        result["error"] = None
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result.update(batches=spies["batches"], records=spies["records"],
                  lookups=local.count if isinstance(local, Lazy) else 0)
    if into is not None:
        result["into_untouched"] = all(bool(t.isnan().all()) for t in into.values())
    if rank == 2 and result["error"] is None:
        result["names_equal"] = sorted(got) == sorted(want)
        result["mismatch"] = [n for n in want if n not in got or not bits_equal(got[n], want[n])]
        result["in_place"] = all(got[n] is into[n] and into[n].data_ptr() == ptrs[n] for n in into)
    return result


def main() -> None:
    import torch.distributed as dist

    job, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    with open(job) as f:
        spec = json.load(f)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results = []
    for case in spec["cases"]:
        results.append(run_case(case, spec["ckpt"], rank))
        with open(os.path.join(out, f"{rank}.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()  # rank 0 hosts the store: nobody leaves while another still talks to it
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
