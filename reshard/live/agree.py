"""The agreement step of a live transfer: before any byte moves, every participant publishes one record on the
transfer's board and every participant judges the same records, so all raise the same error or none does.

A record is a small JSON object: ``rank``, ``backend`` (the group's), ``nccl`` (whether NCCL moves this rank's
tensors), ``device`` (the transfer's device on this rank), ``gpu`` (the physical GPU NCCL binds: host, index,
UUID, PCI address; None without CUDA) and ``problems`` (what this rank found wrong locally, one sentence each).
:func:`verdict` is a pure function of the records; new rules (issue 42: a digest of each rank's plan) add a field
to the record and a clause to the verdict.
"""

from __future__ import annotations

import json
import socket
import time

from reshard.live.watch import TransferError

SHARED_FIX = "NCCL needs one GPU per rank: give each rank its own device (torch.cuda.set_device(local_rank)), " \
             "or use a gloo group"
MAX_FINDINGS = 4  # findings named in the message; the rest are counted


def resolve(device):
    """``device`` as a ``torch.device``, ``"cuda"`` without an index meaning the current CUDA device."""
    import torch

    want = torch.device(device)
    if want.type == "cuda" and want.index is None:
        want = torch.device("cuda", torch.cuda.current_device())
    return want


def uses_nccl(backend: str, device) -> bool:
    """Whether a group whose backend is ``backend`` (``"nccl"``, ``"cpu:gloo,cuda:nccl"``) moves ``device``'s
    tensors with NCCL."""
    backend = backend.lower()
    if ":" in backend:
        return dict(part.split(":", 1) for part in backend.split(",") if ":" in part).get(device.type) == "nccl"
    return backend == "nccl"


def gpu_identity(device) -> dict | None:
    """The physical GPU behind ``device`` (a CUDA ``torch.device``; any other: the current CUDA device), or None
    without CUDA: ``host``, ``index``, ``uuid`` (same GPU, same UUID, whatever ``CUDA_VISIBLE_DEVICES`` says) and
    ``pci`` (domain:bus:device) where torch gives them."""
    import torch

    if not torch.cuda.is_available():
        return None
    index = device.index if device.type == "cuda" and device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    uuid = str(uuid) if uuid is not None and str(uuid).strip("0-") else None
    if uuid and not uuid.startswith("GPU-"):
        uuid = "GPU-" + uuid
    bus = getattr(props, "pci_bus_id", None)
    pci = None if bus is None else \
        f"{getattr(props, 'pci_domain_id', 0) or 0:04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0) or 0:02x}"
    return {"host": socket.gethostname(), "index": index, "uuid": uuid, "pci": pci}


def gpu_key(gpu: dict) -> str:
    """What makes two records' GPUs the same one: the host and the UUID (else the PCI address, else the index)."""
    return f"{gpu['host']}/{gpu.get('uuid') or gpu.get('pci') or 'cuda:%d' % gpu['index']}"


def tensor_problems(me: int, tensors, want) -> list[str]:
    """What is wrong with ``tensors`` ((label such as ``into['w']``, its ``torch.device``) pairs) on rank ``me``
    for NCCL on CUDA device ``want``: one sentence per wrong device, naming its first tensor and counting the rest."""
    wrong: dict[str, list[str]] = {}
    for label, device in tensors:
        if device != want:
            wrong.setdefault(str(device), []).append(label)
    out = []
    for device, labels in wrong.items():
        more = f" (and {len(labels) - 1} more)" if len(labels) > 1 else ""
        it, verb = ("them", "are") if more else ("it", "is")
        if device == "cpu":
            fix = f"but NCCL moves CUDA tensors only: move {it} to {want} (the transfer's device), or use a gloo group"
        elif device.startswith("cuda"):
            fix = (f"not the transfer's device {want}: move {it} to {want}, or make {device} the transfer's device "
                   f"(device='{device}', or torch.cuda.set_device({device.split(':')[-1]}) before the transfer)")
        else:
            fix = f"not the transfer's device {want}: move {it} to {want}"
        out.append(f"rank {me}: {labels[0]}{more} {verb} on {device}, {fix}")
    return out


def check_tensor(me: int, label: str, tensor, want) -> None:
    """Raise :class:`TransferError` when ``tensor`` (called ``label``) is not on ``want`` (None: no rule)."""
    if want is not None and tensor.device != want:
        raise TransferError("live.transfer: " + tensor_problems(me, [(label, tensor.device)], want)[0])


def _ranks(ranks: list[int]) -> str:
    return f"ranks {ranks[0]} and {ranks[1]}" if len(ranks) == 2 else \
        "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _shared(records: list[dict]) -> str:
    """The finding for ``records`` (two or more) whose GPU is one and the same."""
    gpu = records[0]["gpu"]
    name = gpu.get("uuid") or (f"PCI {gpu['pci']}" if gpu.get("pci") else None)
    devices = {r["device"] for r in records}
    ranks = [r["rank"] for r in records]
    if len(devices) == 1:
        what = f"{_ranks(ranks)} share GPU {devices.pop()}" + (f" ({name})" if name else "")
    else:
        what = _ranks([f"{r['rank']} ({r['device']})" for r in records]) + " share one GPU" + \
            (f" ({name})" if name else "")
    return f"{what} on host {gpu['host']}"


def verdict(records: list[dict]) -> str | None:
    """The error every participant raises for ``records`` (one per participant), or None when they may proceed:
    each rank's own problems, then every GPU that two or more NCCL ranks share."""
    findings = [p for r in records for p in r.get("problems", [])]
    by_gpu: dict[str, list[dict]] = {}
    for r in records:
        if r.get("nccl") and r.get("gpu"):
            by_gpu.setdefault(gpu_key(r["gpu"]), []).append(r)
    shared = [_shared(rs) for rs in by_gpu.values() if len(rs) > 1]
    if shared:
        findings.append("; ".join(shared) + "; " + SHARED_FIX)
    if not findings:
        return None
    more = f"; and {len(findings) - MAX_FINDINGS} more" if len(findings) > MAX_FINDINGS else ""
    return "live.transfer: " + "; ".join(findings[:MAX_FINDINGS]) + more


def _wait(watch, ready) -> None:
    """Poll until ``ready()``, checking ``watch``'s board meanwhile; a failure posted when ``ready()`` already
    holds is a rank that went on first (and judged the same records): not this step's failure."""
    while not ready():
        try:
            watch.check()
        except TransferError:
            if not ready():
                raise
            return
        time.sleep(watch.POLL_STORE / 5)


def agree(watch, record: dict) -> list[dict]:
    """Publish ``record`` (this rank's) on ``watch``'s board and return every participant's, in participant order,
    once every participant has read them all (so a rank that raises and exits leaves the store to nobody still
    reading). Waits at most ``watch.timeout`` seconds without progress; raises :class:`TransferError` as
    :meth:`Watch.check` does (another rank failed, the store is gone, a rank never came)."""
    store, n = watch.store, len(watch.participants)
    keys = [watch._key(f"agree/{r}") for r in watch.participants]
    read = watch._key("agree/read")
    watch.clear += keys + [read]
    watch._board(lambda: store.set(keys[watch.participants.index(watch.me)], json.dumps(record)))
    _wait(watch, lambda: watch._board(lambda: store.check(keys)))
    records = [json.loads(watch._board(lambda k=k: store.get(k))) for k in keys]
    watch._board(lambda: store.add(read, 1))
    _wait(watch, lambda: watch._board(lambda: store.add(read, 0)) >= n)
    return records
