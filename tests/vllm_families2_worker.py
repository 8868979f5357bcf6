"""Run under the vLLM venv (RESHARD_VLLM_PYTHON) by tests/test_vllm_families2.py, never imported by the suite.

    python vllm_families2_worker.py REQUEST.json

REQUEST: {"tp": N, "port": P, "jobs": [[MODEL_DIR, OUT_PREFIX], ...]}. vLLM 0.32 itself builds each model at
tensor-parallel size N (gloo on 127.0.0.1, one process per rank) with a dummy load -- no checkpoint is read -- and
each rank writes OUT_PREFIX.rank{r}.json: {"arch": vLLM's model class, "fresh": {name: [shape, dtype]}} with the
names its sharded_state saver / loader uses (``ShardedStateLoader._filter_subtensors`` of the fresh state dict),
or {"error": "<exception type>: <message>"} when vLLM cannot construct the model. As the families-2 probe
(layouts/probes/families-2/vllm_keys.py); the models share one world group, each gets its own TP / PP / EP groups.
"""

import json
import os
import sys
import traceback

for key, value in dict(VLLM_HOST_IP="127.0.0.1", VLLM_LOOPBACK_IP="127.0.0.1", GLOO_SOCKET_IFNAME="lo",
                       VLLM_CPU_KVCACHE_SPACE="1", VLLM_DIST_IDENT="reshard-families2", VLLM_NO_USAGE_STATS="1",
                       HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1").items():
    os.environ.setdefault(key, value)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def fresh_names(folder: str, tp: int, port: int, rank: int) -> dict:
    """vLLM's model for ``folder`` at TP ``tp`` (dummy load): its class and its sharded_state names."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (destroy_model_parallel, ensure_model_parallel_initialized,
                                                 init_distributed_environment)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    args = EngineArgs(model=folder, skip_tokenizer_init=True, dtype="float32", load_format="dummy",
                      tensor_parallel_size=tp, max_model_len=64, enforce_eager=True, seed=0)
    config = args.create_engine_config()
    record = {}
    original = DummyModelLoader.load_weights

    def load_weights(self, model, model_config):
        record["arch"] = type(model).__name__
        record["fresh"] = {k: [list(v.shape), str(v.dtype).removeprefix("torch.")]
                           for k, v in ShardedStateLoader._filter_subtensors(model.state_dict()).items()}
        return original(self, model, model_config)

    DummyModelLoader.load_weights = load_weights
    try:
        with set_current_vllm_config(config):
            if not torch.distributed.is_initialized():  # the world group once, under the first model's config
                init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                             distributed_init_method=f"tcp://127.0.0.1:{port}")
            destroy_model_parallel()  # TP / PP / EP groups per model: the EP group exists only for MoE configs
            ensure_model_parallel_initialized(tp, 1)
            get_model_loader(config.load_config).load_model(vllm_config=config, model_config=config.model_config)
    finally:
        DummyModelLoader.load_weights = original
    return record


def run(rank: int, tp: int, port: int, jobs: list) -> None:
    torch.accelerator.empty_cache = lambda *a, **k: None  # the CPU build calls it; torch's CPU has none
    for folder, out in jobs:
        try:
            record = fresh_names(folder, tp, port, rank)
        except Exception as exc:  # recorded for the test, which names it
            traceback.print_exc()
            record = {"error": f"{type(exc).__name__}: {exc}".strip()[:2000]}
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump(record, f)
        print(f"rank {rank}: {folder}: {record.get('arch') or record.get('error')}", flush=True)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        request = json.load(f)
    tp, port, jobs = request["tp"], request["port"], request["jobs"]
    if tp == 1:
        run(0, tp, port, jobs)
    else:
        mp.spawn(run, args=(tp, port, jobs), nprocs=tp, join=True)
