"""The agreement step of a live transfer: before any byte moves, every participant publishes one record on the
transfer's board and every participant judges the same records, so all raise the same error or none does.

A record is a small JSON object: ``rank``, ``backend`` (the group's), ``nccl`` (whether NCCL moves this rank's
tensors), ``device`` (the transfer's device on this rank), ``gpu`` (the physical GPU NCCL binds: host, index,
UUID, PCI address; None without NCCL or CUDA), ``problems`` (what this rank found wrong locally, one sentence
each) and ``plan`` (its plan's digest, :mod:`reshard.live.compare`). Beside it each rank puts its plan's summary
(:func:`publish`): read only when digests differ, to name the first difference (:func:`check_plans`). A rank not
yet arrived is looked for (``AT``): one waiting in another transfer for this rank (it planned other ranks) is
reported at once, one that never comes is named at the transfer's deadline. :func:`verdict` judges the rest.
"""

from __future__ import annotations

import json
import socket
import time

from reshard.live.watch import TransferError, started

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


AT = "reshard_live/at/"  # + rank: where that rank's latest transfer is ({"prefix", "participants", "call"})
PEEK = 0.25  # seconds between looks at where the ranks not yet arrived are
PEEK_RANKS = 8  # participants looked at each time
NEVER_FIX = "call live.transfer with the same plan on every rank of its source_ranks and target_ranks"


def _set(store, values: dict) -> None:
    try:
        store.multi_set(list(values), list(values.values()))
    except (AttributeError, NotImplementedError):
        for key, value in values.items():
            store.set(key, value)


def _get(store, keys: list[str]) -> list[bytes]:
    try:
        return store.multi_get(keys)
    except (AttributeError, NotImplementedError):
        return [store.get(k) for k in keys]


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else _ranks(ranks)


def _missing(watch, keys: list[str]) -> list[int]:
    """The participants whose key of ``keys`` (one per participant, in order) is not on the board."""
    return [r for r, k in zip(watch.participants, keys) if not watch._board(lambda k=k: watch.store.check([k]))]


def _wait(watch, keys: list[str], late, peek=None) -> None:
    """Poll until every one of ``keys`` is on the board, checking ``watch``'s board meanwhile (a failure posted
    once the keys are all there is a rank that went on first: not this wait's), raising ``late()``'s message past
    its deadline and calling ``peek()`` every ``PEEK`` seconds."""
    store, pause, peeked = watch.store, 0.0002, time.monotonic()
    while not watch._board(lambda: store.check(keys)):
        try:
            watch.check(late)
        except TransferError:
            if watch._board(lambda: store.check(keys)):
                return
            raise
        if peek is not None and time.monotonic() - peeked >= PEEK:
            peek()
            peeked = time.monotonic()
        time.sleep(pause)
        pause = min(2 * pause, watch.POLL_STORE / 5)


def _elsewhere(watch, rank: int) -> dict | None:
    """Where ``rank`` is when it is in another transfer than ``watch``'s, not over: its ``AT`` entry (whose
    record is still on the board, with no ``done``, and which this rank has not started when a participant)."""
    store, key = watch.store, AT + str(rank)
    if not watch._board(lambda: store.check([key])):
        return None
    at = json.loads(watch._board(lambda: store.get(key)))
    if at["prefix"] == watch.prefix or (watch.me in at["participants"] and started(at["participants"]) > at["call"]):
        return None
    live = watch._board(lambda: store.check([at["prefix"] + f"agree/{rank}"]))
    return at if live and not watch._board(lambda: store.check([at["prefix"] + f"done/{rank}"])) else None


def _never_joined(watch, keys: list[str]) -> str:
    missing = _missing(watch, keys)
    if not missing:
        return _stopped(watch, keys)
    at = _elsewhere(watch, missing[0])
    where = f" ({_who(missing[:1])} is in another transfer, between ranks {at['participants']})" if at else ""
    return f"live.transfer: {_who(missing)} never joined the transfer within {watch.timeout:g} s{where} " \
           f"({NEVER_FIX})"


def _stopped(watch, keys: list[str]) -> str:
    missing = _missing(watch, keys)
    who = _who(missing) if missing else "a rank"
    return f"live.transfer: {who} stopped answering during the agreement within {watch.timeout:g} s: a peer hung " \
           "or died (see its own error)"


def _peeker(watch, keys: list[str]):
    """A function raising when a participant not yet arrived is in another transfer that waits for a rank already
    in this one (a plan naming other ranks, or another call between the same ones): they would wait for each
    other until the timeout. Each call looks at up to ``PEEK_RANKS`` participants, in turn. The error names a
    rank here and the one there, the same ones from every rank of both transfers in the usual case (ranks that
    arrived early)."""
    from reshard.live.compare import apart

    store, ranks, cursor = watch.store, watch.participants, [0]

    def arrived(rank: int) -> bool:
        return watch._board(lambda: store.check([keys[ranks.index(rank)]]))

    def peek() -> None:
        window = [ranks[(cursor[0] + i) % len(ranks)] for i in range(min(PEEK_RANKS, len(ranks)))]
        cursor[0] = (cursor[0] + len(window)) % len(ranks)
        for rank in window:
            at = None if rank == watch.me or arrived(rank) else _elsewhere(watch, rank)
            here = next((r for r in at["participants"] if r in ranks and arrived(r)), None) if at else None
            if here is None:
                continue
            ours, theirs = watch._key(f"summary/{here}"), at["prefix"] + f"summary/{rank}"
            if watch._board(lambda: store.check([ours, theirs])):
                a, b = (json.loads(v) for v in watch._board(lambda: _get(store, [ours, theirs])))
                raise TransferError(apart({here: a, rank: b}, {here: watch.call + 1, rank: at["call"] + 1}))
    return peek


def publish(watch, summary: dict) -> None:
    """Put this rank's plan summary (:func:`reshard.live.compare.summary`) on ``watch``'s board, and where this
    rank is (``AT``), in one store operation; the summaries are cleared with the board."""
    watch.clear += [watch._key(f"summary/{r}") for r in watch.participants]
    at = {"prefix": watch.prefix, "participants": watch.participants, "call": watch.call}
    watch._board(lambda: _set(watch.store, {watch._key(f"summary/{watch.me}"): json.dumps(summary),
                                            AT + str(watch.me): json.dumps(at)}))


def agree(watch, record: dict, name: str = "agree") -> list[dict]:
    """Publish ``record`` (this rank's) on ``watch``'s board under ``name`` and return every participant's, in
    participant order. Waits until ``watch``'s deadline (the transfer's): a rank missing then is named (for
    ``"agree"``, the first exchange: "never joined"); raises :class:`TransferError` as :meth:`Watch.check`
    does (another rank failed, the store is gone) and, in the first exchange, when a rank not yet arrived waits
    in another transfer for this one (:func:`publish` first)."""
    store = watch.store
    keys = [watch._key(f"{name}/{r}") for r in watch.participants]
    watch.clear += keys
    watch._board(lambda: store.set(keys[watch.participants.index(watch.me)], json.dumps(record)))
    first = name == "agree"
    _wait(watch, keys, lambda: (_never_joined if first else _stopped)(watch, keys),
          _peeker(watch, keys) if first else None)
    return [json.loads(v) for v in watch._board(lambda: _get(store, keys))]


def release(watch) -> None:
    """Say this rank has read every record and wait until every participant has (at most until the deadline), so
    that a rank that raises next and exits (the store's host among them) leaves nobody reading."""
    keys = [watch._key(f"read/{r}") for r in watch.participants]
    watch.clear += keys
    watch._board(lambda: watch.store.set(keys[watch.participants.index(watch.me)], "1"))
    _wait(watch, keys, lambda: _stopped(watch, keys))


def check_plans(watch, records: list[dict], tensors) -> None:
    """Raise the same :class:`TransferError` on every participant when ``records`` (each with ``plan``: its
    plan's digest) differ: it names two ranks and the first difference of their summaries (:func:`publish`),
    of their tensor lists when that is where they differ (a second exchange, in which only those two ranks
    publish ``tensors(section)``). Returns when every digest is the same."""
    from reshard.live.compare import difference, message, pick, tensor_difference

    picked = pick(records)
    if picked is None:
        return
    a, b, others = picked
    x, y = sorted((a, b))
    sx, sy = (json.loads(v) for v in watch._board(
        lambda: _get(watch.store, [watch._key(f"summary/{x}"), watch._key(f"summary/{y}")])))
    found = difference(sx, sy, x, y)
    text = found.text
    if text is None:
        lists = agree(watch, {"rank": watch.me, "tensors": tensors(found.section) if watch.me in (x, y) else None},
                      "detail")
        held = {r["rank"]: r["tensors"] for r in lists}
        text = tensor_difference(found.section, held[x], held[y], x, y)
    release(watch)
    raise TransferError(message(a, b, text, found.fix, others))
