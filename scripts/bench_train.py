#!/usr/bin/env python
"""Training-framework sources for scripts/bench.py: a DeepSpeed ZeRO-3 checkpoint and an FSDP2 DCP folder of the
bench's Llama, each written by the framework itself on this machine's CPUs (2 processes on 127.0.0.1, gloo), and
cached like the synthetic sources (a marker file beside the folder; a folder whose marker or files do not match is
made again).

- ``deepspeed_zero3``: ``ROOT/`` with ``latest``, ``global_step1/`` (``zero_pp_rank_{0,1}_mp_rank_00_model_states.pt``
  and ``bf16_zero_pp_rank_{0,1}_mp_rank_00_optim_states.pt``: fp32 master partitions and both Adam moments),
  DeepSpeed's ``zero_to_fp32.py`` copy and the HF ``config.json`` beside ``latest``. Made by
  ``transformers.LlamaForCausalLM`` built under ``deepspeed.zero.Init`` (bf16), ``deepspeed.initialize`` (torch
  AdamW), one training step on 8 tokens and ``save_checkpoint`` (deepspeed with ``DS_ACCELERATOR=cpu``).
- ``fsdp2_dcp``: ``ROOT/`` with ``pytorch_model_fsdp_0/`` (accelerate's SHARDED_STATE_DICT naming: ``model.`` + the
  HF names; ``.metadata`` + ``__{0,1}_0.distcp``) and ``config.json``, as accelerate / the HF Trainer leave it in
  ``checkpoint-N/``. Made by ``fully_shard`` of every decoder layer and of the model (fp32 parameters, FSDP2's
  ``Shard(0)``), then ``dcp.save({"model": get_model_state_dict(model)})``. Model only: no optimizer folder.

The model is the bench's Llama for a size (``bench_model.choose_shapes``: hidden 2048, vocab 32003 at 1 GiB), whose
``--sizes`` value is its bf16 size; both sources store it in fp32 (ZeRO-3's masters, FSDP2's parameters), twice
that, and the ZeRO-3 one has the two Adam moments besides (about 6x the bf16 size on disk in all).

    python scripts/bench_train.py deepspeed_zero3 OUT --size 1
    python scripts/bench_train.py fsdp2_dcp OUT --size 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

_HERE = str(Path(__file__).resolve().parent)
if sys.path[:1] != [_HERE]:
    sys.path[:] = [_HERE] + [p for p in sys.path if p != _HERE]

from bench_model import choose_shapes, hf_config, marker_matches, tensor_specs  # noqa: E402

#: source kind -> what it is, for the report
TRAIN_SOURCES = {
    "deepspeed_zero3": "DeepSpeed ZeRO-3 checkpoint, world 2, bf16 + fp32 masters + Adam moments",
    "fsdp2_dcp": "FSDP2 DCP folder (accelerate naming, pytorch_model_fsdp_0/), world 2, fp32, model only",
}
WORLD = 2
#: bump when what the generators write changes, so that cached sources are made again
TRAIN_GENERATOR_VERSION = 1
MASTER_BYTES = 4  # both sources store fp32


def train_plan(kind: str, size_gib: float) -> dict[str, Any]:
    shapes = choose_shapes(size_gib, "llama")
    specs = tensor_specs(shapes)
    name, shape = max(specs, key=lambda s: math.prod(s[1]))
    params = sum(math.prod(s) for _, s in specs)
    return {"generator_version": TRAIN_GENERATOR_VERSION, "kind": kind, "requested_gib": size_gib, "world": WORLD,
            "shapes": shapes, "config": hf_config(shapes), "params": params,
            "fp32_model_bytes": params * MASTER_BYTES,
            "largest_tensor": {"name": name, "shape": list(shape), "bytes": math.prod(shape) * MASTER_BYTES,
                               "dtype": "F32"}}


def expected_files(kind: str) -> list[str]:
    if kind == "deepspeed_zero3":
        return ["latest", "config.json", "zero_to_fp32.py"] + [
            f"global_step1/{p}zero_pp_rank_{r}_mp_rank_00_{what}_states.pt"
            for r in range(WORLD) for p, what in (("", "model"), ("bf16_", "optim"))]
    return ["config.json", "pytorch_model_fsdp_0/.metadata"] + [
        f"pytorch_model_fsdp_0/__{r}_0.distcp" for r in range(WORLD)]


def dcp_folder(kind: str, root: Path) -> Path:
    """The folder torch's ``dcp_to_torch_save`` is given: the DCP folder itself."""
    return root / "pytorch_model_fsdp_0" if kind == "fsdp2_dcp" else root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _llama(config: dict[str, Any]):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    return LlamaForCausalLM(LlamaConfig(**cfg))


def _batch(vocab: int, rank: int):
    import torch

    return torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(rank))


def _deepspeed_worker(rank: int, out: str, plan: dict[str, Any], port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(WORLD))
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401 - imported (lazily loaded modules too)
    # before zero.Init patches Tensor.__new__, which torch._dynamo's import then refuses
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    ds_config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
        "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
    }
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = _llama(plan["config"])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    ids = _batch(plan["config"]["vocab_size"], rank)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out, tag="global_step1")
    if rank == 0:
        Path(out, "config.json").write_text(json.dumps(plan["config"], indent=2) + "\n")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _fsdp2_worker(rank: int, out: str, plan: dict[str, Any], port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = _llama(plan["config"])  # fp32, the same on every rank (seeded)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dcp.save({"model": get_model_state_dict(model)},
             storage_writer=dcp.FileSystemWriter(os.path.join(out, "pytorch_model_fsdp_0")))
    if rank == 0:
        Path(out, "config.json").write_text(json.dumps(plan["config"], indent=2) + "\n")
    dist.barrier()
    dist.destroy_process_group()


WORKERS = {"deepspeed_zero3": _deepspeed_worker, "fsdp2_dcp": _fsdp2_worker}


def make(kind: str, out: Path, size_gib: float) -> None:
    """Write source ``kind`` of the bench's Llama for ``size_gib`` to ``out`` (replaced), with WORLD processes."""
    import torch.multiprocessing as mp

    plan = train_plan(kind, size_gib)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    mp.spawn(WORKERS[kind], args=(str(out), plan, _free_port()), nprocs=WORLD, join=True)
    missing = [f for f in expected_files(kind) if not (out / f).is_file()]
    if missing:
        raise SystemExit(f"{kind}: the framework did not write {', '.join(missing)} under {out}")


def _cache_valid(src: Path, marker: Path, plan: dict[str, Any]) -> bool:
    return marker_matches(marker, plan) and all((src / f).is_file() for f in expected_files(plan["kind"]))


def ensure_train_source(cache_dir: Path, kind: str, size_gib: float, run, log=print) -> tuple[Path | None, dict, str | None]:
    """The cached source ``kind`` for ``size_gib``, made when missing or stale: ``run(cmd, name)`` runs the
    generator as a child (the bench's ``run_child``, returning its result dict). Returns (folder or None, plan,
    error)."""
    plan = train_plan(kind, size_gib)
    src = cache_dir / f"{kind}-{size_gib:g}GiB"
    marker = cache_dir / f"{kind}-{size_gib:g}GiB.json"
    if _cache_valid(src, marker, plan):
        return src, plan, None
    log(f"[bench] making {src} with {'deepspeed' if kind == 'deepspeed_zero3' else 'FSDP2'} "
        f"({WORLD} processes; fp32 model {plan['fp32_model_bytes'] / 2**30:.2f} GiB) ...")
    marker.unlink(missing_ok=True)
    tmp = cache_dir / f"{kind}-{size_gib:g}GiB.tmp"
    r = run([sys.executable, str(Path(__file__).resolve()), kind, str(tmp), "--size", f"{size_gib:g}"],
            f"make-{kind}-{size_gib:g}")
    if r["rc"] != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        return None, plan, f"no {kind} source (generator rc={r['rc']})"
    if src.exists():
        shutil.rmtree(src)
    tmp.rename(src)
    os.sync()
    marker.write_text(json.dumps(plan, indent=1) + "\n")
    return src, plan, None


# --------------------------------------------------------------------------------------
# Operations on these sources (their command lines; scripts/bench_ops.py registers them)
# --------------------------------------------------------------------------------------

#: ``dcp_to_torch_save`` of the DCP folder into DST/model.pt (torch's own converter: loads the whole state dict)
DCP_TO_TORCH_SAVE_CODE = r"""
import os, sys
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
os.makedirs(sys.argv[2], exist_ok=True)
dcp_to_torch_save(sys.argv[1], os.path.join(sys.argv[2], "model.pt"))
"""


def zero_to_fp32_cmd(src: Path, dst: Path) -> list[str]:
    """DeepSpeed's own converter, the copy ``save_checkpoint`` put in the root (safetensors out)."""
    return [sys.executable, str(src / "zero_to_fp32.py"), str(src), str(dst), "--safe_serialization"]


def dcp_to_torch_save_cmd(src: Path, dst: Path) -> list[str]:
    return [sys.executable, "-c", DCP_TO_TORCH_SAVE_CODE, str(dcp_folder("fsdp2_dcp", src)), str(dst)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=list(TRAIN_SOURCES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--size", type=float, required=True, help="the model's bf16 size in GiB (as bench.py --sizes)")
    args = ap.parse_args(argv)
    make(args.kind, args.out.resolve(), args.size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
