"""The operations scripts/bench.py times: their names and sources, the command line of each, and the
converter under test (its environment and whether it answers ``convert --help``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from bench_timing import log_tail, run_child

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
    "hf_to_torch_dist": ("hf", ["--to", "megatron", "--megatron-format", "torch_dist", "--tp", "8"]),
    "torch_dist_to_hf": ("torch_dist", ["--to", "hf"]),
    "hf_to_megatron_tp2_ep4": ("hf", ["--to", "megatron", "--tp", "2", "--ep", "4"]),
    "megatron_tp2_ep4_to_hf": ("megatron_tp2_ep4", ["--to", "hf"]),
    "megatron_tp8_to_vllm_tp2": ("megatron_tp8", ["--to", "vllm", "--tp", "2"]),
    "hf_to_trtllm_tp8": ("hf", ["--to", "trtllm", "--tp", "8"]),
    "trtllm_tp8_to_hf": ("trtllm_tp8", ["--to", "hf"]),
    "hf_to_meta_tp1": ("hf", ["--to", "meta", "--tp", "1"]),  # Meta pads nothing: the odd vocab needs tp 1
    "meta_tp1_to_hf": ("meta_tp1", ["--to", "hf"]),
    "fp8_quantize": ("hf", None),  # makes the hf_fp8 source (scripts/bench_fp8.py); not timed by default
    "hf_fp8_to_bf16_hf": ("hf_fp8", ["--to", "hf"]),  # block-FP8 source (the model quantised) dequantised to bf16
    "mxfp4_make": ("hf", None),  # makes the hf_mxfp4 source (scripts/bench_mxfp4.py); not timed by default
    "hf_mxfp4_to_bf16_hf": ("hf_mxfp4", ["--to", "hf"]),  # gpt-oss as released (MXFP4 experts) dequantised to bf16
    "hf_to_fp32_hf": ("hf", ["--to", "hf", "--dtype", "fp32"]),  # a plain cast: twice the bytes out (not default)
    "pcp": ("hf", None),
    "naive": ("hf", None),
    # training-framework sources (scripts/bench_train.py; not in the default set): DeepSpeed ZeRO-3 at world 2 ->
    # HF in the training dtype (bf16, the masters cast) and in fp32 (--master-weights), next to DeepSpeed's own
    # zero_to_fp32; an FSDP2 DCP folder (fp32) -> HF at the layout's default dtype and cast to bf16, next to torch's
    # dcp_to_torch_save
    "deepspeed_zero3_to_hf": ("deepspeed_zero3", ["--to", "hf"]),
    "deepspeed_zero3_to_fp32_hf": ("deepspeed_zero3", ["--to", "hf", "--master-weights"]),
    "zero_to_fp32": ("deepspeed_zero3", None),
    "fsdp2_dcp_to_hf": ("fsdp2_dcp", ["--to", "hf"]),
    "fsdp2_dcp_to_bf16_hf": ("fsdp2_dcp", ["--to", "hf", "--dtype", "bf16"]),
    "dcp_to_torch_save": ("fsdp2_dcp", None),
    # a vision-language source (--model qwen2_5_vl): the language model split at TP 2 and the tower kept whole on
    # every rank (Megatron-Bridge's HF modules), and back
    "vlm_hf_to_megatron_tp2": ("hf", ["--to", "megatron", "--tp", "2"]),
    "vlm_megatron_tp2_to_hf": ("megatron_tp2", ["--to", "hf"]),
    # MaxText (tensorstore; not in the default set): the generated Llama written as a MaxText parameter checkpoint,
    # and read back from one laid out as MaxText's converter writes it (all layers in each chunk: the unstack pass)
    "hf_to_maxtext": ("hf", ["--to", "maxtext", "--maxtext-model", "llama3-8b"]),
    "maxtext_prepare": ("hf", None),  # makes the maxtext_converter source (scripts/bench_maxtext.py)
    "maxtext_to_hf": ("maxtext_converter", ["--to", "hf"]),
    # MaxText's own converter on the same model (scripts/bench_maxtext_converter.py; needs RESHARD_MAXTEXT_PYTHON)
    "maxtext_converter_to_maxtext": ("hf", None),
    "maxtext_converter_to_hf": ("maxtext_converter", None),
}
#: operations for Mixture-of-Experts sources only (the default for --model mixtral, with cp)
MOE_OPS = ("hf_to_megatron_tp2_ep4", "megatron_tp2_ep4_to_hf")
#: the default operations of --model deepseek: the MoE ones and its FP8 version dequantised
DEEPSEEK_OPS = (*MOE_OPS, "hf_fp8_to_bf16_hf")
#: operations for vision-language sources only (the default for --model qwen2_5_vl, with cp and pcp)
VLM_OPS = ("vlm_hf_to_megatron_tp2", "vlm_megatron_tp2_to_hf")
#: left out of the default set: the cast next to which FP8 dequantisation is read (same output bytes from half
#: the source size: ``--sizes 1`` cast against ``--sizes 2`` FP8)
CAST_OPS = ("hf_to_fp32_hf",)
#: source kinds other than the generated HF checkpoint -> the op whose output is that source (run untimed first
#: when the op itself is not among those timed)
DERIVED_SOURCES = {"megatron_tp8": "hf_to_megatron_tp8", "torch_dist": "hf_to_torch_dist",
                   "megatron_tp2_ep4": "hf_to_megatron_tp2_ep4", "trtllm_tp8": "hf_to_trtllm_tp8",
                   "meta_tp1": "hf_to_meta_tp1", "hf_fp8": "fp8_quantize", "megatron_tp2": "vlm_hf_to_megatron_tp2",
                   "maxtext_converter": "maxtext_prepare"}
#: operations that only prepare a source: left out of the default set
PREPARE_ONLY = ("fp8_quantize", "maxtext_prepare")
#: the MaxText rows (need tensorstore): named with --ops, not in the default set
MAXTEXT_OPS = ("hf_to_maxtext", "maxtext_to_hf", "maxtext_converter_to_maxtext", "maxtext_converter_to_hf")
#: gpt-oss as released (a generated MXFP4 checkpoint whose bf16 output is the model's size) to bf16 HF: named with
#: --ops, not in the default set
MXFP4_OPS = ("hf_mxfp4_to_bf16_hf",)
DERIVED_SOURCES["hf_mxfp4"] = "mxfp4_make"
PREPARE_ONLY += ("mxfp4_make",)
#: the copy references each conversion is timed next to: one `cp -r`, and the same bytes in N parallel streams
REFERENCES = ("cp", "pcp")
#: the default operations of the "wide" model (1 layer, 1 GiB MLP weights)
WIDE_OPS = ("hf_to_megatron_tp8", "megatron_tp8_to_hf", "megatron_tp8_to_vllm_tp2", "hf_to_megatron_tp1")
#: the operations on training-framework sources (made and cached by scripts/bench_train.py): left out of the
#: default set, and held to the issue-33 memory bound (peak RSS <= 2 x largest tensor + 0.5 GiB)
TRAIN_OPS = ("deepspeed_zero3_to_hf", "deepspeed_zero3_to_fp32_hf", "zero_to_fp32", "fsdp2_dcp_to_hf",
             "fsdp2_dcp_to_bf16_hf", "dcp_to_torch_save")
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


# The same bytes as `cp -r SRC DST`, copied by N streams at once (N = cores by default): the files are laid end to
# end, cut into N equal byte ranges, and each thread copies its range with copy_file_range (the GIL is released
# in the call). "The copy limit" of this disk, rather than of one cp process.
PCP_CODE = r"""
import os, sys, threading
src, dst, streams = sys.argv[1], sys.argv[2], int(sys.argv[3])
files = []
for folder, _, names in os.walk(src):
    out = os.path.join(dst, os.path.relpath(folder, src))
    os.makedirs(out, exist_ok=True)
    for name in sorted(names):
        files.append((os.path.join(folder, name), os.path.join(out, name), os.path.getsize(os.path.join(folder, name))))
for _, target, size in files:
    with open(target, "wb") as f:
        f.truncate(size)
total = sum(size for _, _, size in files)
errors = []
def stream(lo, hi):
    try:
        copy(lo, hi)
    except OSError as exc:
        errors.append(exc)
def copy(lo, hi):
    start = 0
    for source, target, size in files:
        a, b = max(lo, start), min(hi, start + size)
        if a < b:
            fi, fo = os.open(source, os.O_RDONLY), os.open(target, os.O_WRONLY)
            offset, left = a - start, b - a
            while left:
                n = os.copy_file_range(fi, fo, min(left, 1 << 30), offset, offset)
                if n <= 0:
                    raise OSError("copy_file_range copied nothing")
                offset, left = offset + n, left - n
            os.close(fi); os.close(fo)
        start += size
threads = [threading.Thread(target=stream, args=(i * total // streams, (i + 1) * total // streams))
           for i in range(streams)]
for t in threads: t.start()
for t in threads: t.join()
if errors:
    sys.exit(f"pcp: {errors[0]}")
"""


def parallel_streams() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def compile_bytecode() -> str:
    """Compile this checkout's ``reshard`` package to bytecode (``__pycache__``), as an installed package is.
    An environment with ``PYTHONDONTWRITEBYTECODE=1`` (this machine's) otherwise makes every timed run compile
    the package from source again (about 0.2 s here); Python still reads bytecode that exists. Returns what was
    done, for the report."""
    import compileall

    ok = compileall.compile_dir(str(SRC_DIR / "reshard"), quiet=1)
    how = "compiled by the bench" if ok else "compiling failed: runs compile from source"
    return how + (" (PYTHONDONTWRITEBYTECODE is set)" if os.environ.get("PYTHONDONTWRITEBYTECODE") else "")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def default_reshard() -> list[str]:
    return [sys.executable, "-m", "reshard"]


TORCHRUN = "@torchrun"


def add_torchrun_op(op: str, processes: int) -> str:
    """Register ``OP@torchrunN``: conversion ``op`` run by ``torchrun --standalone --nproc-per-node N``."""
    name = f"{op}{TORCHRUN}{processes}"
    OPS[name] = OPS[op]
    return name


def torchrun_base(op: str) -> tuple[str, int] | None:
    """(conversion, processes) of an ``OP@torchrunN`` name, else None."""
    base, sep, n = op.partition(TORCHRUN)
    return (base, int(n)) if sep else None


def source_args(op: str, src: Path) -> list[str]:
    """Convert arguments a source kind needs besides the op's own: a DCP folder saves no config, so the one
    beside it is given as --config."""
    return ["--config", str(src / "config.json")] if OPS[op][0] == "fsdp2_dcp" else []


def build_cmd(op: str, src: Path, dst: Path, workers: int | None, reshard: list[str] | None = None) -> list[str]:
    distributed = torchrun_base(op)
    if distributed is not None:  # the module form: torchrun starts `python -m reshard` itself
        base, n = distributed
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), "-m",
                "reshard", "convert", str(src), str(dst), *OPS[base][1], *source_args(base, src), "--overwrite"]
    if op == "cp":
        return ["cp", "-r", str(src), str(dst)]
    if op == "pcp":
        return [sys.executable, "-c", PCP_CODE, str(src), str(dst), str(parallel_streams())]
    if op == "naive":
        return [sys.executable, "-c", NAIVE_CODE, str(src), str(dst)]
    if op == "zero_to_fp32":
        from bench_train import zero_to_fp32_cmd

        return zero_to_fp32_cmd(src, dst)
    if op == "dcp_to_torch_save":
        from bench_train import dcp_to_torch_save_cmd

        return dcp_to_torch_save_cmd(src, dst)
    if op == "fp8_quantize":
        return [sys.executable, str(Path(__file__).resolve().parent / "bench_fp8.py"), str(src), str(dst)]
    if op == "mxfp4_make":
        return [sys.executable, str(Path(__file__).resolve().parent / "bench_mxfp4.py"), str(src), str(dst)]
    if op == "maxtext_prepare":
        return [sys.executable, str(Path(__file__).resolve().parent / "bench_maxtext.py"), str(src), str(dst)]
    if op.startswith("maxtext_converter_"):
        from bench_maxtext_converter import command

        return command(op, src, dst)
    cmd = [*(reshard or default_reshard()), "convert", str(src), str(dst), *OPS[op][1], *source_args(op, src),
           "--overwrite"]
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
