#!/usr/bin/env python
"""Benchmark ``reshard convert`` against ``cp -r`` and a naive load-everything baseline.

For each requested model size (GiB) this script

1. generates (or reuses from its cache) a synthetic Llama-shaped Hugging Face
   checkpoint in bf16: ``config.json``, ``model-0000i-of-0000N.safetensors`` and
   ``model.safetensors.index.json``.  The data are written tensor by tensor with
   a hand-written safetensors header, so generating a large model never holds
   more than a few MiB in memory;
2. times, side by side, ``cp -r SRC DST`` + ``sync`` and each conversion run as a
   child process (``python -m reshard convert ... --overwrite``) + ``sync``,
   dropping the page cache before every run when ``/proc/sys/vm/drop_caches`` is
   writable (otherwise the runs are flagged "warm cache");
3. records wall time, ratio to ``cp``, throughput, and the child's peak RSS
   (``ru_maxrss`` from ``os.wait4``, which covers the child and every descendant
   it reaped, as a max not a sum) relative to the largest tensor;
4. writes ``OUT/bench.json`` (raw runs + summary), ``OUT/bench.md`` (Markdown
   table, also printed) and, with ``--plot``, ``OUT/bench.png``.

Example::

    python scripts/bench.py --sizes 1 2 4 --out bench-out
    python scripts/bench.py --sizes 0.01 --repeat 1 --ops cp naive --out /tmp/b
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

GIB = 1 << 30
MIB = 1 << 20
BENCH_VERSION = 1
# Bump when the generated data or layout changes, so that cached sources are rebuilt.
GENERATOR_VERSION = 1

REPO_ROOT = Path(__file__).resolve().parents[1]
SRC_DIR = REPO_ROOT  # the package folder reshard/ sits at the top level

# --------------------------------------------------------------------------------------
# Operations
# --------------------------------------------------------------------------------------

#: operation name -> (source kind, convert arguments after SRC DST, or None for non-converter ops)
OPS: dict[str, tuple[str, list[str] | None]] = {
    "cp": ("hf", None),
    "hf_to_megatron_tp8": ("hf", ["--to", "megatron", "--tp", "8"]),
    "megatron_tp8_to_tp4": ("megatron_tp8", ["--to", "megatron", "--tp", "4"]),
    "megatron_tp8_to_hf": ("megatron_tp8", ["--to", "hf"]),
    "hf_to_megatron_tp1": ("hf", ["--to", "megatron", "--tp", "1"]),
    "hf_to_vllm_tp4": ("hf", ["--to", "vllm", "--tp", "4"]),
    "hf_to_vllm_tp8": ("hf", ["--to", "vllm", "--tp", "8"]),
    "naive": ("hf", None),
}
CACHE_MODES = ("data", "all", "warm")
CONVERTER_OPS = [name for name, (_, args) in OPS.items() if args is not None]
MEGATRON_TP8_ARGS = OPS["hf_to_megatron_tp8"][1]

NAIVE_CODE = r"""
import glob, os, sys
import torch
from safetensors.torch import load_file
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst, exist_ok=True)
state = {}
for shard in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
    state.update(load_file(shard))
torch.save(state, os.path.join(dst, "model.pt"))
"""

# --------------------------------------------------------------------------------------
# Synthetic Llama shapes
# --------------------------------------------------------------------------------------

HIDDEN_CANDIDATES = (8192, 4096, 2048, 1024, 512, 256, 128, 64)
NUM_KV_HEADS = 8


def vocab_for_hidden(hidden: int) -> int:
    """Odd vocab size (never a multiple of 128), big enough that the embedding is the
    largest tensor (> intermediate * hidden = 3.5 * hidden**2), capped at 32003."""
    return min(32003, 16 * hidden + 3)


def min_layers_for_hidden(hidden: int) -> int:
    """A width is used only with at least this many layers, so 1, 2 and 4 GiB models share hidden 2048 (16+ layers
    for 4096): the model grows by depth while the largest tensor stays put, which is what "memory flat in
    model size" is measured against."""
    return max(4, hidden * hidden // 2**20)


def model_shapes(hidden: int, layers: int) -> dict[str, Any]:
    head_dim = 128 if hidden >= 4096 else hidden // 32
    heads = hidden // head_dim
    return {
        "hidden_size": hidden,
        "intermediate_size": hidden * 7 // 2,  # Llama-3 ratio; divisible by 8 for every candidate
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": head_dim,
        "vocab_size": vocab_for_hidden(hidden),
    }


def tensor_specs(shapes: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor, in the order they are written."""
    h = shapes["hidden_size"]
    inter = shapes["intermediate_size"]
    hd = shapes["head_dim"]
    q = shapes["num_attention_heads"] * hd
    kv = shapes["num_key_value_heads"] * hd
    vocab = shapes["vocab_size"]
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(shapes["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    specs += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return specs


def param_count(shapes: dict[str, Any]) -> int:
    return sum(math.prod(s) for _, s in tensor_specs(shapes))


def choose_shapes(size_gib: float) -> dict[str, Any]:
    """Llama-like shapes whose bf16 size is close to ``size_gib``: the widest hidden size
    that still leaves a realistic number of layers, then the layer count that best fits."""
    if not size_gib > 0:
        raise ValueError(f"size must be positive, got {size_gib}")
    target_params = size_gib * GIB / 2
    for hidden in HIDDEN_CANDIDATES:
        base = param_count(model_shapes(hidden, 0))
        per_layer = param_count(model_shapes(hidden, 1)) - base
        layers = max(1, round((target_params - base) / per_layer))
        if layers >= min_layers_for_hidden(hidden) or hidden == HIDDEN_CANDIDATES[-1]:
            shapes = model_shapes(hidden, layers)
            # fine-tune the FFN width (within 2.5x..4x hidden, multiple of hidden/8) to close
            # the gap left by the integer layer count
            step = hidden // 8
            mlp_params = 3 * hidden * shapes["intermediate_size"] * layers
            rest = param_count(shapes) - mlp_params
            inter = (target_params - rest) / (3 * hidden * layers)
            inter = min(4 * hidden, max(5 * hidden // 2, round(inter / step) * step))
            shapes["intermediate_size"] = int(inter)
            return shapes
    raise AssertionError("unreachable")


def hf_config(shapes: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shapes["hidden_size"],
        "intermediate_size": shapes["intermediate_size"],
        "num_hidden_layers": shapes["num_hidden_layers"],
        "num_attention_heads": shapes["num_attention_heads"],
        "num_key_value_heads": shapes["num_key_value_heads"],
        "head_dim": shapes["head_dim"],
        "vocab_size": shapes["vocab_size"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "max_position_embeddings": 8192,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def expected_megatron_largest(shapes: dict[str, Any], tp: int) -> int:
    """Largest per-rank tensor (bytes, bf16) of a Megatron-Core TP=tp checkpoint, assuming
    vocab padding to a multiple of 128 * tp and fused QKV / gate+up (linear_fc1)."""
    h = shapes["hidden_size"]
    inter = shapes["intermediate_size"]
    hd = shapes["head_dim"]
    mult = 128 * tp
    padded_vocab = -(-shapes["vocab_size"] // mult) * mult
    qkv_rows = (shapes["num_attention_heads"] + 2 * shapes["num_key_value_heads"]) * hd
    candidates = [padded_vocab // tp * h, 2 * inter // tp * h, qkv_rows // tp * h, h * inter // tp]
    return 2 * max(candidates)


# --------------------------------------------------------------------------------------
# Streaming safetensors writer
# --------------------------------------------------------------------------------------

PATTERN_ELEMS = 1_048_573  # odd period, so rows of a matrix do not repeat column-aligned


def _bf16_pattern(name: str, numel: int, is_norm: bool) -> np.ndarray:
    """Deterministic, non-zero bf16 bit patterns (as uint16) for one tensor."""
    n = min(numel, PATTERN_ELEMS)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    vals = rng.standard_normal(n, dtype=np.float32)
    vals = (1.0 + 0.02 * vals) if is_norm else (0.02 * vals)
    bits = (vals.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    bits[(bits & 0x7FFF) == 0] = 0x3C00  # no +-0: 0x3C00 is bf16 0.0078125
    return bits


def _write_tensor_data(f, name: str, shape: tuple[int, ...]) -> None:
    numel = math.prod(shape)
    block = _bf16_pattern(name, numel, is_norm=len(shape) == 1).tobytes()
    remaining = numel * 2
    while remaining:
        chunk = block if remaining >= len(block) else block[:remaining]
        f.write(chunk)
        remaining -= len(chunk)


def write_safetensors(path: Path, specs: list[tuple[str, tuple[int, ...]]]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in specs:
        nbytes = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for name, shape in specs:
            _write_tensor_data(f, name, shape)
    os.replace(tmp, path)


def read_safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def plan_shards(
    specs: list[tuple[str, tuple[int, ...]]], shard_limit: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Greedy split into shards of at most ``shard_limit`` bytes (a single larger tensor gets
    its own shard).  The target is capped at half the model so even tiny models get >= 2
    shards and the multi-shard path of the converter is always exercised."""
    total = sum(math.prod(s) * 2 for _, s in specs)
    target = max(1, min(shard_limit, -(-total // 2)))
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    cur = 0
    for name, shape in specs:
        nbytes = math.prod(shape) * 2
        if shards[-1] and cur + nbytes > target:
            shards.append([])
            cur = 0
        shards[-1].append((name, shape))
        cur += nbytes
    return shards


def source_plan(size_gib: float, shard_limit: int) -> dict[str, Any]:
    shapes = choose_shapes(size_gib)
    shards = plan_shards(tensor_specs(shapes), shard_limit)
    n = len(shards)
    return {
        "generator_version": GENERATOR_VERSION,
        "requested_gib": size_gib,
        "config": hf_config(shapes),
        "shapes": shapes,
        "shards": [
            {"file": f"model-{i + 1:05d}-of-{n:05d}.safetensors", "tensors": [[nm, list(s)] for nm, s in sh]}
            for i, sh in enumerate(shards)
        ],
    }


def _shard_bytes(shard: dict[str, Any]) -> int:
    return sum(math.prod(s) * 2 for _, s in shard["tensors"])


def _cache_valid(src: Path, marker: Path, plan: dict[str, Any]) -> bool:
    try:
        if json.loads(marker.read_text()) != plan:
            return False
    except (OSError, ValueError):
        return False
    for shard in plan["shards"]:
        p = src / shard["file"]
        if not p.is_file():
            return False
        # header + data; the header length is not known from the plan, so check the data part
        try:
            with open(p, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
        except (OSError, struct.error):
            return False
        if p.stat().st_size != 8 + n + _shard_bytes(shard):
            return False
    return (src / "config.json").is_file() and (src / "model.safetensors.index.json").is_file()


def ensure_source(cache_dir: Path, size_gib: float, shard_limit: int, log=print) -> tuple[Path, dict, bool]:
    """Generate (or reuse) the HF checkpoint for ``size_gib``.  Returns (dir, plan, generated)."""
    plan = source_plan(size_gib, shard_limit)
    src = cache_dir / f"llama-{size_gib:g}GiB"
    marker = cache_dir / f"llama-{size_gib:g}GiB.json"  # kept outside the checkpoint dir
    if _cache_valid(src, marker, plan):
        return src, plan, False
    log(f"[bench] generating {src} ({size_gib:g} GiB requested) ...")
    marker.unlink(missing_ok=True)
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    for shard in plan["shards"]:
        specs = [(nm, tuple(s)) for nm, s in shard["tensors"]]
        write_safetensors(src / shard["file"], specs)
        for nm, _ in specs:
            weight_map[nm] = shard["file"]
        total += _shard_bytes(shard)
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    (src / "config.json").write_text(json.dumps(plan["config"], indent=2) + "\n")
    os.sync()
    marker.write_text(json.dumps(plan, indent=1) + "\n")
    return src, plan, True


# --------------------------------------------------------------------------------------
# Inspection helpers
# --------------------------------------------------------------------------------------


def dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def largest_tensor_in_dir(path: Path) -> dict[str, Any] | None:
    """Largest tensor found in the safetensors / torch files under ``path``.  Safetensors
    headers are parsed directly; torch files are opened with ``torch.load(mmap=True)`` so
    no tensor data is read.  Returns None when nothing could be inspected."""
    best: dict[str, Any] | None = None
    errors: list[str] = []

    def consider(name: str, nbytes: int, shape: list[int], file: Path) -> None:
        nonlocal best
        if best is None or nbytes > best["bytes"]:
            best = {"name": name, "bytes": int(nbytes), "shape": [int(x) for x in shape], "file": str(file.relative_to(path))}

    for f in sorted(path.rglob("*.safetensors")):
        try:
            for name, info in read_safetensors_header(f).items():
                start, end = info["data_offsets"]
                consider(name, end - start, info["shape"], f)
        except Exception as e:  # noqa: BLE001 - inspection is best effort
            errors.append(f"{f.name}: {e!r}")
    torch_files = [f for ext in ("*.pt", "*.pth", "*.bin") for f in sorted(path.rglob(ext))]
    if torch_files:
        try:
            import torch
        except ImportError as e:
            errors.append(repr(e))
            torch_files = []
        for f in torch_files:
            try:
                obj = torch.load(f, map_location="cpu", mmap=True, weights_only=False)
            except Exception as e:  # noqa: BLE001
                errors.append(f"{f.name}: {e!r}")
                continue
            stack: list[tuple[str, Any]] = [("", obj)]
            while stack:
                prefix, o = stack.pop()
                if isinstance(o, torch.Tensor):
                    consider(prefix, o.numel() * o.element_size(), list(o.shape), f)
                elif isinstance(o, dict):
                    stack.extend((f"{prefix}.{k}" if prefix else str(k), v) for k, v in o.items())
                elif isinstance(o, (list, tuple)):
                    stack.extend((f"{prefix}[{i}]", v) for i, v in enumerate(o))
            del obj
    if best is not None and errors:
        best["errors"] = errors
    return best


# --------------------------------------------------------------------------------------
# Running children
# --------------------------------------------------------------------------------------


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict_files(root: Path) -> bool:
    """Flush, then drop every file under ``root`` from the page cache (``POSIX_FADV_DONTNEED`` on clean pages):
    the checkpoint is read cold while programs and libraries stay cached, as they are for a tool in use."""
    os.sync()
    if not hasattr(os, "posix_fadvise"):
        return False
    for folder, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def make_cold(mode: str, source: Path) -> str:
    """Prepare one run under cache ``mode``; returns what the run actually got: data, all or warm."""
    if mode == "all" and drop_caches():
        return "all"
    if mode in ("all", "data") and evict_files(source):
        return "data"
    os.sync()
    return "warm"


def _proc_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def _rss_anon(pid: int) -> tuple[int, int]:
    rss = anon = 0
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith(b"RssAnon:"):
                    anon = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, anon


class TreeSampler(threading.Thread):
    """Samples the summed RSS / anonymous RSS of the descendants of a process (the wrapper).  Only a
    supplement to ``ru_maxrss``: sampled (may miss short peaks) and summed (shared pages of
    forked workers are counted once per process, so an upper bound across processes)."""

    def __init__(self, pid: int, interval: float = 0.1):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.stop_event = threading.Event()
        self.peak_rss = self.peak_anon = 0
        self.max_procs = 0

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                pids = _proc_tree(self.pid)[1:] if os.path.exists(f"/proc/{self.pid}") else []
            except OSError:
                pids = []
            rss = anon = 0
            for pid in pids:
                r, a = _rss_anon(pid)
                rss += r
                anon += a
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_anon = max(self.peak_anon, anon)
            self.max_procs = max(self.max_procs, len(pids))
            self.stop_event.wait(self.interval)


# Why a wrapper: Linux folds the memory high-water mark of the process that execs into the
# new program's ru_maxrss (the pre-exec address space, shared under vfork or copied under
# fork), so a child spawned straight from this (numpy/torch-importing) process would report
# at least our own peak.  The wrapper is a bare ``python -I -S`` (~9 MiB) that forks, execs the
# command, reaps it with os.wait4 and writes that rusage (and its own precise timing) to a
# file; the reported peak is therefore max(true peak of the command and the descendants it
# reaped, ~9 MiB).
WRAPPER_CODE = r"""
import os, sys, time
out, cmd = sys.argv[1], sys.argv[2:]
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        os.write(2, ("exec failed: %r\n" % (e,)).encode())
    os._exit(127)
_, status, ru = os.wait4(pid, 0)
t1 = time.perf_counter()
with open(out, "w") as f:
    f.write("%d %d %r %r %r\n" % (pid, ru.ru_maxrss, ru.ru_utime, ru.ru_stime, t1 - t0))
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


def run_child(cmd: list[str], log_path: Path, env: dict[str, str], timeout: float | None) -> dict[str, Any]:
    """Run ``cmd`` (through the rusage wrapper) and then ``sync``.  Returns exit code, timings
    (``cmd_s`` measured inside the wrapper around fork..wait4, ``wall_s`` = ``cmd_s`` + sync)
    and the peak RSS of the command."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    rusage_path = log_path.with_name(log_path.name + ".rusage")
    rusage_path.unlink(missing_ok=True)
    timed_out = threading.Event()
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", WRAPPER_CODE, str(rusage_path), *cmd],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        sampler = TreeSampler(proc.pid)
        sampler.start()
        timer = None
        if timeout:
            def _kill() -> None:
                timed_out.set()
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

            timer = threading.Timer(timeout, _kill)
            timer.start()
        _, status, outer_ru = os.wait4(proc.pid, 0)
        t1 = time.perf_counter()
        proc.returncode = os.waitstatus_to_exitcode(status)  # already reaped; keep Popen from waiting
        if timer:
            timer.cancel()
        sampler.stop_event.set()
        os.sync()
        t2 = time.perf_counter()
        sampler.join()
    try:
        _pid, maxrss_kib, utime, stime, inner_s = rusage_path.read_text().split()
        maxrss, user_s, sys_s, cmd_s = int(maxrss_kib) * 1024, float(utime), float(stime), float(inner_s)
        rusage_path.unlink()
    except (OSError, ValueError):  # wrapper killed: fall back to outer numbers (peak inflated)
        maxrss, user_s, sys_s, cmd_s = outer_ru.ru_maxrss * 1024, outer_ru.ru_utime, outer_ru.ru_stime, t1 - t0
    rc = proc.returncode
    return {
        "rc": rc,
        "timed_out": timed_out.is_set(),
        "wall_s": cmd_s + (t2 - t1),
        "cmd_s": cmd_s,
        "sync_s": t2 - t1,
        "outer_wall_s": t2 - t0,
        "peak_rss_bytes": maxrss,  # ru_maxrss is in KiB on Linux
        "tree_peak_rss_bytes_sampled": sampler.peak_rss,
        "tree_peak_anon_bytes_sampled": sampler.peak_anon,
        "max_processes_sampled": sampler.max_procs,
        "user_s": user_s,
        "sys_s": sys_s,
    }


def log_tail(path: Path, n: int = 2000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-n:].decode(errors="replace")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def rmtree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


# --------------------------------------------------------------------------------------
# Benchmark driver
# --------------------------------------------------------------------------------------


def fmt_size(size: float) -> str:
    return f"{size:g}"


def default_reshard() -> list[str]:
    return [sys.executable, "-m", "reshard"]


def build_cmd(op: str, src: Path, dst: Path, workers: int | None, reshard: list[str] | None = None) -> list[str]:
    if op == "cp":
        return ["cp", "-r", str(src), str(dst)]
    if op == "naive":
        return [sys.executable, "-c", NAIVE_CODE, str(src), str(dst)]
    cmd = [*(reshard or default_reshard()), "convert", str(src), str(dst), *OPS[op][1], "--overwrite"]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    return cmd


def probe_converter(env: dict[str, str], logs: Path, reshard: list[str]) -> dict[str, Any]:
    cmd = [*reshard, "convert", "--help"]
    res = run_child(cmd, logs / "convert-help.log", dict(env, COLUMNS="200"), timeout=300)  # unwrapped help
    text = log_tail(logs / "convert-help.log", 200_000)
    return {
        "cmd": cmd,
        "rc": res["rc"],
        "available": res["rc"] == 0,
        "vllm": res["rc"] == 0 and "vllm" in text.lower(),
        "help_peak_rss_bytes": res["peak_rss_bytes"],
        "help_tail": text[-1500:] if res["rc"] != 0 else "",
    }


def summarize(runs: list[dict], sizes_info: dict[str, dict]) -> list[dict]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        if r["op"] == "cp" and r.get("source_kind", "hf") != "hf":
            continue  # a cp of the Megatron TP8 source, paired with a megatron_tp8_* run: only in that ratio
        groups.setdefault((r["size"], r["op"]), []).append(r)
    cp_median: dict[str, float] = {}
    for (size, op), rs in groups.items():
        ok = [r["wall_s"] for r in rs if r["status"] == "ok"]
        if op == "cp" and ok:
            cp_median[size] = statistics.median(ok)
    summary = []
    for (size, op), rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        times = [r["wall_s"] for r in ok]
        info = sizes_info[size]
        src_largest = info["largest_tensor"]["bytes"]
        row: dict[str, Any] = {
            "size": size,
            "size_gib": rs[0]["size_gib"],
            "op": op,
            "runs": len(rs),
            "ok_runs": len(ok),
            "status": "ok" if len(ok) == len(rs) else ("failed" if not ok else f"partial ({len(ok)}/{len(rs)} ok)"),
        }
        if not ok:
            first = rs[0]
            row["status"] = first["status"] if first["status"] not in ("failed", "timeout") else f"{first['status']} (rc={first.get('rc')})"
            summary.append(row)
            continue
        median = statistics.median(times)
        src_bytes = ok[0]["source_bytes"]
        peak = max(r["peak_rss_bytes"] for r in ok)
        out_largest = next((r["output_largest_tensor"] for r in reversed(ok) if r.get("output_largest_tensor")), None)
        out_bytes = out_largest["bytes"] if out_largest else None
        pair_ratios = [r["ratio_to_paired_cp"] for r in ok if "ratio_to_paired_cp" in r]
        if op == "cp":
            ratio, ratio_kind = 1.0, "self"
        elif pair_ratios:
            ratio, ratio_kind = statistics.median(pair_ratios), "median of paired runs"
        elif size in cp_median:
            ratio, ratio_kind = median / cp_median[size], "median over median cp"
        else:
            ratio, ratio_kind = None, None
        row.update(
            median_s=median,
            min_s=min(times),
            max_s=max(times),
            ratio_to_cp=ratio,
            ratio_kind=ratio_kind,
            ratio_min=min(pair_ratios) if pair_ratios else None,
            ratio_max=max(pair_ratios) if pair_ratios else None,
            paired_cp_median_s=statistics.median(r["paired_cp_s"] for r in ok if "paired_cp_s" in r)
            if pair_ratios else None,
            source_bytes=src_bytes,
            gib_per_s=src_bytes / GIB / median if median > 0 else None,
            peak_rss_bytes=peak,
            peak_rss_mib=peak / MIB,
            tree_peak_rss_bytes_sampled=max(r["tree_peak_rss_bytes_sampled"] for r in ok),
            tree_peak_anon_bytes_sampled=max(r["tree_peak_anon_bytes_sampled"] for r in ok),
            largest_source_tensor_bytes=src_largest,
            largest_output_tensor_bytes=out_bytes,
            largest_output_tensor=out_largest,
            rss_per_largest_tensor=peak / src_largest,
            rss_bound_bytes=2 * src_largest + GIB // 2,
            within_rss_bound=peak <= 2 * src_largest + GIB // 2,
            rss_per_largest_output_tensor=(peak / out_bytes) if out_bytes else None,
            output_bytes=ok[-1].get("output_bytes"),
        )
        summary.append(row)
    return summary


def flatness(summary: list[dict]) -> list[dict]:
    """Per operation: peak RSS at the largest size over the smallest (flat = within 10%)."""
    by_op: dict[str, list[dict]] = {}
    for row in summary:
        if row.get("ok_runs"):
            by_op.setdefault(row["op"], []).append(row)
    out = []
    for op in OPS:
        rows = sorted(by_op.get(op, []), key=lambda r: r["size_gib"])
        if len(rows) < 2:
            continue
        growth = rows[-1]["peak_rss_bytes"] / rows[0]["peak_rss_bytes"]
        tensor_growth = rows[-1]["largest_source_tensor_bytes"] / rows[0]["largest_source_tensor_bytes"]
        out.append({"op": op, "from_gib": rows[0]["size_gib"], "to_gib": rows[-1]["size_gib"],
                    "rss_growth": growth, "largest_tensor_growth": tensor_growth, "flat": growth <= 1.10})
    return out


def _fmt_s(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def render_markdown(result: dict[str, Any]) -> str:
    lines = ["# reshard benchmark", ""]
    env = result["environment"]
    cache_text = {
        "data": "the source checkpoint's files flushed and evicted from the page cache before every run "
                "(read cold; programs and libraries stay cached)",
        "all": "the whole page cache dropped before every run (checkpoint, programs and libraries read cold)",
        "warm": "warm (flushed, nothing evicted)",
    }[result["cache_mode"]]
    lines.append(
        f"- {env['cpus']} CPUs, {env['mem_gib']:.1f} GiB RAM, Python {env['python']}, torch {env['torch']}; "
        f"page cache: **{result['cache_mode']}**: {cache_text}"
    )
    caches = sorted({r.get("cache") for r in result["runs"] if r.get("cache")} - {result["cache_mode"]})
    if caches:
        lines.append(f"- **some runs fell back to cache mode {', '.join(caches)}** (see bench.json)")
    lines.append(
        f"- repeat={result['args']['repeat']}, workers={result['args']['workers'] if result['args']['workers'] is not None else 'converter default'}; "
        "times include a final `sync`. × cp is the median over repeats of (run time / time of a `cp -r` + `sync` of "
        "the same source run right next to it), with min–max: the disk's speed drifts between runs, a ratio of "
        "neighbours cancels the drift"
    )
    b = result.get("baselines", {})
    if b:
        parts = [f"{k.replace('_peak_rss_bytes', '')} {v / MIB:.0f} MiB" for k, v in b.items() if v]
        if parts:
            lines.append("- baseline peak RSS (no data): " + ", ".join(parts))
    for size, info in sorted(result["sizes_info"].items(), key=lambda kv: float(kv[0])):
        s = info["shapes"]
        lt = info["largest_tensor"]
        lines.append(
            f"- {size} GiB source: {info['source_bytes'] / GIB:.3f} GiB in {info['num_shards']} shards; hidden {s['hidden_size']}, "
            f"ffn {s['intermediate_size']}, {s['num_hidden_layers']} layers, {s['num_attention_heads']}/{s['num_key_value_heads']} heads "
            f"(dim {s['head_dim']}), vocab {s['vocab_size']}; largest tensor `{lt['name']}` {lt['bytes'] / MIB:.2f} MiB"
        )
    lines += [
        "",
        "| size GiB | operation | median s | min–max s | × cp (min–max) | GiB/s | peak RSS MiB | RSS / largest tensor | "
        "≤ 2×largest + 0.5 GiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for row in sorted(result["summary"], key=lambda r: (r["size_gib"], list(OPS).index(r["op"]))):
        size = row["size"]
        if row["ok_runs"] == 0:
            lines.append(f"| {size} | {row['op']} | {row['status']} | | | | | | |")
            continue
        ratio = f"{row['ratio_to_cp']:.2f}" if row["ratio_to_cp"] is not None else "n/a"
        if row.get("ratio_min") is not None and row["ratio_max"] != row["ratio_min"]:
            ratio += f" ({row['ratio_min']:.2f}–{row['ratio_max']:.2f})"
        per = f"{row['rss_per_largest_tensor']:.2f}"
        out_b = row["largest_output_tensor_bytes"]
        if out_b and out_b != row["largest_source_tensor_bytes"]:
            per += f" (out {out_b / MIB:.2f} MiB: {row['rss_per_largest_output_tensor']:.2f})"
        op = row["op"] if row["status"] == "ok" else f"{row['op']} ({row['status']})"
        lines.append(
            f"| {size} | {op} | {_fmt_s(row['median_s'])} | {_fmt_s(row['min_s'])}–{_fmt_s(row['max_s'])} | {ratio} | "
            f"{row['gib_per_s']:.3g} | {row['peak_rss_mib']:.0f} | {per} | "
            f"{'yes' if row['within_rss_bound'] else 'NO'} |"
        )
    flat = flatness(result["summary"])
    if flat:
        lines += ["", "Peak RSS growth from the smallest to the largest size (flat = within 10%):", ""]
        lines += [f"- {f['op']}: {f['from_gib']:g} -> {f['to_gib']:g} GiB: x{f['rss_growth']:.2f} "
                  f"({'flat' if f['flat'] else 'grows'}; largest tensor x{f['largest_tensor_growth']:.2f})"
                  for f in flat]
    lines += [
        "",
        "Peak RSS is `ru_maxrss` of the child from `os.wait4` (the max over the child and the descendants it "
        "reaped, not a sum; it includes file-backed pages such as mmapped safetensors) taken over all repeats. "
        "RSS / largest tensor divides it by the largest source tensor; `(out …)` gives the largest tensor found in the "
        "output when it differs. GiB/s is source bytes (the Megatron TP8 checkpoint for `megatron_tp8_*`) / median time. "
        "bench.json also has sampled whole-process-tree RSS and anonymous RSS.",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    by_op: dict[str, list[dict]] = {}
    for row in result["summary"]:
        if row["ok_runs"]:
            by_op.setdefault(row["op"], []).append(row)
    for op in OPS:
        rows = sorted(by_op.get(op, []), key=lambda r: r["size_gib"])
        if not rows:
            continue
        xs = [r["size_gib"] for r in rows]
        ax_t.plot(xs, [r["median_s"] for r in rows], marker="o", label=op)
        ax_m.plot(xs, [r["peak_rss_mib"] for r in rows], marker="o", label=op)
    ax_t.set(xlabel="model size (GiB)", ylabel="median wall time incl. sync (s)", title="time")
    ax_m.set(xlabel="model size (GiB)", ylabel="peak RSS (MiB)", title="peak RSS")
    for ax in (ax_t, ax_m):
        ax.grid(True, alpha=0.3)
    ax_m.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[1.0, 2.0, 4.0], help="model sizes in GiB (default: 1 2 4)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per (size, operation) (default: 3)")
    ap.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory (default: bench-out)")
    ap.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS), metavar="OP",
                    help="operations to run (default: all): " + ", ".join(OPS))
    ap.add_argument("--workers", type=int, default=None, help="pass --workers N to reshard convert (only when given)")
    ap.add_argument("--keep", action="store_true", help="keep the outputs of the last repeat under OUT/outputs")
    ap.add_argument("--plot", action="store_true", help="write OUT/bench.png (needs matplotlib)")
    ap.add_argument("--cache-dir", type=Path, default=None, help="where generated sources are cached (default: OUT/sources)")
    ap.add_argument("--shard-gib", type=float, default=2.0, help="max safetensors shard size in GiB (default: 2)")
    ap.add_argument("--timeout", type=float, default=None, help="kill a run after this many seconds")
    ap.add_argument("--cache", choices=CACHE_MODES, default="data",
                    help="before every run: 'data' (default) flushes and evicts the source checkpoint's files from "
                         "the page cache, 'all' drops the whole page cache (programs and libraries too, needs root), "
                         "'warm' only flushes")
    ap.add_argument("--reshard", default=None, metavar="CMD",
                    help="command that runs the CLI, shell-split (default: the current python -m reshard, "
                         "with this checkout's src/ first on PYTHONPATH)")
    args = ap.parse_args(argv)
    args.reshard = shlex.split(args.reshard) if args.reshard else default_reshard()
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if any(not s > 0 for s in args.sizes):
        ap.error("--sizes must be positive")
    args.sizes = list({fmt_size(s): s for s in args.sizes}.values())
    args.ops = [op for op in OPS if op in set(args.ops)]  # canonical order: cp, hf_to_megatron_tp8, ...
    return args



def keep_output(src: Path, dst: Path) -> None:
    """Move a finished output to ``dst`` (``--keep``), replacing what was there."""
    rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(src), str(dst))

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cache_dir = (args.cache_dir or out / "sources").resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    logs = out / "logs"
    rmtree(work)
    work.mkdir()
    env = child_env()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:  # not `import torch`: keep this process small (see WRAPPER_CODE)
        from importlib.metadata import version

        torch_version = version("torch")
    except Exception:  # noqa: BLE001
        torch_version = "n/a"
    result: dict[str, Any] = {
        "bench_version": BENCH_VERSION,
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv if argv is None else ["bench.py", *argv],
        "args": {"sizes": args.sizes, "repeat": args.repeat, "ops": args.ops, "workers": args.workers,
                 "keep": args.keep, "shard_gib": args.shard_gib, "timeout": args.timeout},
        "environment": {
            "cpus": os.cpu_count(),
            "mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB,
            "python": platform.python_version(),
            "torch": torch_version,
            "platform": platform.platform(),
        },
        "cache_mode": args.cache,
        "baselines": {},
        "converter": None,
        "sizes_info": {},
        "runs": [],
        "summary": [],
    }

    def save() -> None:
        result["summary"] = summarize(result["runs"], result["sizes_info"])
        result["flatness"] = flatness(result["summary"])
        tmp = out / "bench.json.tmp"
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, out / "bench.json")

    # Baselines: interpreter + torch import, and the CLI's --help (also tells whether vllm exists).
    need_converter = any(op in CONVERTER_OPS for op in args.ops)
    if "naive" in args.ops:
        r = run_child([sys.executable, "-c", "import torch, safetensors.torch"], logs / "baseline-torch.log", env, 300)
        result["baselines"]["python_import_torch_peak_rss_bytes"] = r["peak_rss_bytes"] if r["rc"] == 0 else None
    if need_converter:
        conv = probe_converter(env, logs, args.reshard)
        result["converter"] = conv
        if conv["available"]:
            result["baselines"]["reshard_convert_help_peak_rss_bytes"] = conv["help_peak_rss_bytes"]
        else:
            log(f"[bench] `{' '.join(conv['cmd'])}` failed (rc={conv['rc']}); converter ops are skipped")
    conv = result["converter"] or {"available": False, "vllm": False}

    def op_unavailable(op: str) -> str | None:
        if OPS[op][1] is None:
            return None
        if not conv["available"]:
            return f"converter unavailable (convert --help rc={conv.get('rc')})"
        if op.startswith("hf_to_vllm") and not conv["vllm"]:
            return "not available"
        return None

    try:
        for size in args.sizes:
            key = fmt_size(size)
            t0 = time.perf_counter()
            src, plan, generated = ensure_source(cache_dir, size, int(args.shard_gib * GIB), log)
            headers = [read_safetensors_header(src / s["file"]) for s in plan["shards"]]
            name, info = max(((n, i) for h in headers for n, i in h.items()),
                             key=lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0])
            src_bytes = dir_bytes(src)
            result["sizes_info"][key] = {
                "source_dir": str(src),
                "generated": generated,
                "prepare_s": time.perf_counter() - t0,
                "source_bytes": src_bytes,
                "num_shards": len(plan["shards"]),
                "num_tensors": sum(len(h) for h in headers),
                "shapes": plan["shapes"],
                "largest_tensor": {"name": name, "bytes": info["data_offsets"][1] - info["data_offsets"][0], "shape": info["shape"]},
                "expected_megatron_largest_tensor_bytes": {
                    f"tp{tp}": expected_megatron_largest(plan["shapes"], tp) for tp in (1, 4, 8)
                },
            }
            log(f"[bench] size {key} GiB: {src} ({src_bytes / GIB:.3f} GiB, {'generated' if generated else 'cached'})")

            meg8: Path | None = None
            meg8_error: str | None = None
            needs_meg8 = any(OPS[op][0] == "megatron_tp8" and not op_unavailable(op) for op in args.ops)

            def source_for(op: str) -> tuple[Path | None, str | None]:
                nonlocal meg8, meg8_error
                if OPS[op][0] == "hf":
                    return src, None
                if meg8 is None and meg8_error is None and "hf_to_megatron_tp8" not in args.ops:
                    # not produced by a timed hf_to_megatron_tp8 run: prepare it, untimed
                    dst = work / f"{key}-megatron_tp8-source"
                    rmtree(dst)
                    log("[bench]   preparing Megatron TP8 source (untimed) ...")
                    r = run_child(build_cmd("hf_to_megatron_tp8", src, dst, args.workers, args.reshard),
                                  logs / f"{key}-prepare-megatron_tp8.log", env, args.timeout)
                    if r["rc"] == 0:
                        meg8 = dst
                    else:
                        meg8_error = f"no Megatron TP8 source (hf_to_megatron_tp8 rc={r['rc']})"
                if meg8 is not None:
                    return meg8, None
                return None, meg8_error or "no Megatron TP8 source (hf_to_megatron_tp8 did not succeed)"

            def timed(op: str, rep: int, op_src: Path, src_b: int, paired_with: str | None = None) -> dict[str, Any]:
                """One cold run of ``op`` on ``op_src`` (its output deleted unless kept)."""
                nonlocal meg8
                run: dict[str, Any] = {"size": key, "size_gib": size, "op": op, "repeat": rep,
                                       "source_kind": "hf" if op_src == src else "megatron_tp8"}
                if paired_with:
                    run["paired_with"] = paired_with
                dst = work / f"{key}-{op}"
                rmtree(dst)
                free = shutil.disk_usage(work).free
                if free < src_b * 1.2 + 256 * MIB:
                    run["status"] = f"skipped: low disk ({free / GIB:.1f} GiB free)"
                    return run
                cache = make_cold(args.cache, op_src)
                cmd = build_cmd(op, op_src, dst, args.workers, args.reshard)
                log_path = logs / f"{key}-{op}{'-for-' + paired_with if paired_with else ''}-{rep}.log"
                r = run_child(cmd, log_path, env, args.timeout)
                ok = r["rc"] == 0 and dst.exists() and dir_bytes(dst) > 0
                run.update(r, cmd=cmd, log=str(log_path), source_bytes=src_b, cache=cache)
                if ok:
                    run["status"] = "ok"
                    run["output_bytes"] = dir_bytes(dst)
                    if op != "cp":
                        run["output_largest_tensor"] = largest_tensor_in_dir(dst)
                else:
                    run["status"] = "timeout" if r["timed_out"] else "failed"
                    run["error_tail"] = log_tail(log_path)
                log(f"[bench]   {key} GiB {op}{' (paired with ' + paired_with + ')' if paired_with else ''} #{rep}: "
                    f"{run['status']} {r['wall_s']:.3f}s (cmd {r['cmd_s']:.3f}s + sync {r['sync_s']:.3f}s), "
                    f"peak RSS {r['peak_rss_bytes'] / MIB:.0f} MiB")
                if ok and op == "hf_to_megatron_tp8" and meg8 is None and needs_meg8:
                    meg8 = work / f"{key}-megatron_tp8-source"
                    rmtree(meg8)
                    dst.rename(meg8)
                elif ok and args.keep and rep == args.repeat - 1 and not paired_with:
                    keep_output(dst, out / "outputs" / key / op)
                else:
                    rmtree(dst)
                return run

            # With cp among the ops, every other op is timed next to its own cp of the same source (cp first on
            # even repeats, second on odd ones): the disk's speed drifts, and a ratio of neighbours cancels it.
            paired = "cp" in args.ops and len(args.ops) > 1
            for rep in range(args.repeat):
                for op in args.ops:
                    if paired and op == "cp":
                        continue
                    why = op_unavailable(op)
                    op_src, err = (None, why) if why else source_for(op)
                    if err:
                        result["runs"].append({"size": key, "size_gib": size, "op": op, "repeat": rep, "status": err})
                        continue
                    src_b = src_bytes if op_src == src else dir_bytes(op_src)
                    cp_first = rep % 2 == 0
                    cp_run = timed("cp", rep, op_src, src_b, paired_with=op) if paired and cp_first else None
                    run = timed(op, rep, op_src, src_b)
                    if paired and not cp_first:
                        cp_run = timed("cp", rep, op_src, src_b, paired_with=op)
                    if cp_run is not None:
                        result["runs"].append(cp_run)
                        if cp_run["status"] == "ok" and run["status"] == "ok":
                            run["paired_cp_s"] = cp_run["wall_s"]
                            run["ratio_to_paired_cp"] = run["wall_s"] / cp_run["wall_s"]
                    result["runs"].append(run)
                    save()
            if meg8 is not None:
                if args.keep:
                    keep_output(meg8, out / "outputs" / key / "megatron_tp8_source")
                else:
                    rmtree(meg8)
            save()
    finally:
        rmtree(work)
        save()

    md = render_markdown(result)
    (out / "bench.md").write_text(md)
    print(md)
    if args.plot:
        try:
            plot(result, out / "bench.png")
        except ImportError:
            log("[bench] --plot needs matplotlib (pip install matplotlib); bench.json/bench.md were written")
            return 3
        log(f"[bench] wrote {out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
