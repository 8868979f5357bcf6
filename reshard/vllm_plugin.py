"""vLLM load format ``reshard``: serve any checkpoint reshard reads, each worker reading only its own slices.

Installing reshard registers :func:`register` under vLLM's ``vllm.general_plugins`` entry point; vLLM calls it in
every process it starts, and it registers a model loader for ``load_format="reshard"``::

    vllm.LLM(model="llama-tp8-megatron", load_format="reshard", tensor_parallel_size=4)

The folder needs a Hugging Face ``config.json`` (vLLM builds the model from it; reshard's Megatron and torch_dist
outputs write one). Each worker calls :func:`reshard.load_rank` for its tensor-parallel rank in vLLM's own
per-rank names (the ``sharded_state`` layout), in the model's dtype, and copies the tensors into the model's
parameters; it reads only the source byte ranges its rank needs. vLLM is imported only when vLLM loads the plugin:
it is not a dependency of reshard. Pipeline parallelism is not supported by this loader (tensor and expert
parallelism are).
"""

from __future__ import annotations

LOAD_FORMAT = "reshard"

_registered = False


def register() -> None:
    """Register the ``reshard`` load format with vLLM (the ``vllm.general_plugins`` entry point); idempotent."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(_loader_class())
    _registered = True


def _loader_class():
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    class ReshardModelLoader(BaseModelLoader):
        """Loads this worker's rank with :func:`reshard.load_rank` from the checkpoint folder ``model``."""

        def __init__(self, load_config):
            super().__init__(load_config)
            extra = dict(load_config.model_loader_extra_config or {})
            unknown = sorted(set(extra) - {"vocab_size", "architecture", "mapping"})
            if unknown:
                raise ValueError(f"load_format='reshard' takes model_loader_extra_config keys vocab_size, "
                                 f"architecture and mapping, not {unknown}")
            self.options = extra

        def download_model(self, model_config) -> None:
            """Nothing to fetch: ``model`` is a local folder (or ``hf://ORG/NAME``, fetched by reshard)."""

        def load_weights(self, model, model_config) -> None:
            load_into(model, model_config.model, model_config.dtype, self.options)

    return ReshardModelLoader


def worker_rank() -> tuple[int, int, bool]:
    """(tensor-parallel rank, size, expert parallel) of the calling vLLM worker; refuses pipeline parallelism."""
    from vllm.config import get_current_vllm_config
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    if get_pp_group().world_size > 1:
        raise ValueError("load_format='reshard' loads tensor-parallel ranks only: use pipeline_parallel_size=1")
    expert_parallel = bool(get_current_vllm_config().parallel_config.enable_expert_parallel)
    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(), expert_parallel


def load_into(model, folder: str, dtype, options: dict) -> None:
    """Copy this worker's rank of the checkpoint in ``folder`` into ``model``'s parameters and buffers, by the
    names vLLM's ``state_dict()`` uses; every name must be filled exactly once, with the parameter's shape."""
    import reshard

    rank, tp, expert_parallel = worker_rank()
    weights = reshard.load_rank(folder, to="vllm", tp=tp, rank=rank, expert_parallel=expert_parallel, dtype=dtype,
                                **options)
    state = model.state_dict()
    unexpected = sorted(set(weights) - set(state))
    if unexpected:
        missing_keys = _missing_config_keys(folder, options)
        if missing_keys:
            raise ValueError(f"vLLM built this model without '{unexpected[0]}' because {folder}/config.json lacks "
                             f"{', '.join(f'{k}={v!r}' for k, v in missing_keys)}: add them to config.json (reshard "
                             "convert --to vllm writes them)")
        raise ValueError(f"reshard made tensor '{unexpected[0]}' that the vLLM model has no parameter for "
                         f"(the vLLM version names this architecture's weights differently?)")
    for name, tensor in weights.items():
        param = state[name]
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"'{name}': reshard made shape {list(tensor.shape)}, the vLLM model's parameter is "
                             f"{list(param.shape)}")
        param.data.copy_(tensor)
    filled = {_memory(state[name]) for name in weights}
    missing = sorted(n for n, t in state.items() if t.numel() and _memory(t) not in filled)
    if missing:
        raise ValueError(f"the checkpoint has no tensor for the vLLM model's '{missing[0]}' "
                         f"({len(missing)} missing)")


def _missing_config_keys(folder: str, options: dict) -> list[tuple[str, object]]:
    """The settings the family's mapping requires (``requires``: e.g. DeepSeek-V3's ``scoring_func`` and
    ``topk_method``, without which vLLM builds no router bias) that ``folder``'s config.json does not spell out."""
    import json
    import os

    from reshard.mapping_vlm import family_for_architecture

    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        config = json.load(f)
    architecture = options.get("architecture") or (config.get("architectures") or [None])[0]
    if not architecture:
        return []
    spelling = family_for_architecture(architecture, options.get("mapping"), config).config.architecture(architecture)
    return [(k, v) for k, v in (spelling.requires if spelling else ()) if k not in config]


def _memory(tensor) -> tuple:
    """Where a tensor's elements live: names that share it (vLLM's tied lm_head and embedding) are filled once."""
    return tensor.device, tensor.data_ptr(), tuple(tensor.shape)
