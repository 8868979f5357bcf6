"""megatron-core 0.16.1's own ``LLaVAModel`` (CLIP ViT + MLP projector + GPT) built on the CPU at TP=T, as the
judge of a Megatron LLaVA checkpoint's names and per-rank shapes.  Written independently of reshard.

Run as::

    python tests/mcore_llava_harness.py load CKPT_DIR OUT_DIR [--config CONFIG.json] [--tp 2]
                                              [--format auto|torch|torch_dist] [--vision-layers N]
    python tests/mcore_llava_harness.py selftest OUT_DIR [--config CONFIG.json] [--tp 2] [--seed N] [--no-torch-dist]

The script spawns the T ranks itself (torch.multiprocessing, gloo on the loopback interface, rendezvous through a
file store in a private temporary folder) and waits for all of them (``mcore_dist_harness.spawn_and_join``; strays
are reaped as there).  megatron-core's forward needs CUDA (``LLaVAModel`` builds CUDA tensors), so only the model's
state is checked, never its output.

The model comes from a Hugging Face ``LlavaForConditionalGeneration`` ``config.json`` (``--config``; ``load``
defaults to ``CKPT_DIR/config.json``, ``selftest`` to :data:`TINY_LLAVA`, the research plan's tiny LLaVA):

* language model: megatron-core ``GPTModel`` with the local layer spec, from the Megatron-LM args a Llama / Mistral
  / Qwen2 run has (``mcore_args_harness.config_from_args``: RMSNorm, SwiGLU, GQA, RoPE, untied unless
  ``tie_word_embeddings``, a QKV bias for Qwen2 or ``attention_bias``); the vocab is padded by Megatron-LM's rule
  (``make_vocab_size_divisible_by`` * T, the divisor from the rank file's args, else 128) and checked against the
  rank file's ``args.padded_vocab_size`` when it has one;
* vision: ``CLIPViTModel`` (``vision_model_type="clip"``: ``class_token``, ``conv1`` without bias, ``ln_pre``, no
  ``ln_post``) with megatron-core's local ViT layer spec, every one of the tower's blocks, as Megatron-LM's
  examples build and convert them (``--vision-layers`` overrides), split at the language
  model's TP, ``drop_vision_class_token = vision_feature_select_strategy == "default"``, ``img_h = img_w =
  image_size``, ``patch_dim = patch_size``;
* projector: ``MultimodalProjector`` "mlp" (``vision_projection.encoder.linear_fc1`` Hv -> H column-parallel,
  ``linear_fc2`` H -> H row-parallel, biases per ``multimodal_projector_bias``), Megatron-LM's
  ``examples/multimodal`` settings.

``load`` checks, on each rank r:

* ``torch`` format (``CKPT_DIR/<release|iter_%07d>/mp_rank_{r:02d}/model_optim_rng.pt``, the iteration named by
  ``latest_checkpointed_iteration.txt``, read with ``torch.load(weights_only=True)``): the ``model`` dict's names
  against megatron-core's own ``state_dict()`` -- *every* key, ``_extra_state`` included (megatron-core's
  LLaVA load hook would silently forgive a missing one) -- their shapes, then ``load_state_dict(strict=True)``;
* ``torch_dist`` (``.metadata`` in the iteration folder): the checkpoint's keys and global shapes (read from the
  DCP metadata) against ``model.sharded_state_dict()``'s, then ``dist_checkpointing.load(...,
  strict=StrictHandling.RETURN_ALL)`` and ``load_state_dict(strict=True)``;
* both: every tensor megatron-core does not split over TP (norms, class token, conv1, position table, row-parallel
  biases) is identical on all ranks.

and writes ``OUT_DIR/result_rank{r}.json``::

    {"rank", "tp", "format", "path", "dims", "padded_vocab", "args_padded_vocab",
     "missing": [names the model has, the checkpoint lacks], "unexpected": [names the checkpoint has, the model lacks],
     "unexpected_objects": [torch_dist only: non-tensor checkpoint keys the model does not ask for, e.g. TE-only
                            _extra_state, rng_state -- Megatron-LM's default strictness ignores these],
     "shape_mismatch": [{"key", "model", "checkpoint"}], "replica_mismatch": [names], "load_error": str | null,
     "loaded_equal": bool (the model's tensors after the load equal the file's), "ok": bool}

plus ``OUT_DIR/model_rank{r}.json``: megatron-core's own ``state_dict()`` (name -> per-rank shape, ``null`` for
``_extra_state``) and ``sharded_state_dict()`` (key -> global shape and this rank's chunks: offset, local shape;
objects as ``null``).
The exit code is 0 whenever the check ran, whatever it found.

``selftest`` proves the checks before any converter is trusted: each rank saves megatron-core's own ``state_dict()``
(seed S, seeded noise on the 1-D tensors) in Megatron-LM's torch layout under ``OUT_DIR/selftest/<case>/`` and
checks it with a model built from another seed, for the cases ``clean`` (ok, and the loaded tensors equal the saved
ones), ``renamed`` (one vision qkv weight renamed: missing + unexpected), ``reshaped``
(``vision_projection.encoder.linear_fc1.weight`` stored whole on every rank: shape), ``dropped_extra_state`` (one
vision ``_extra_state`` left out: missing, though megatron-core's own strict load passes), ``replica`` (rank 1's
``vision_model.class_token`` perturbed: replica mismatch), ``wrong_config`` (the clean folder against a model of one
vision block more: missing), and, unless ``--no-torch-dist``, ``torch_dist`` (``dist_checkpointing.save`` of
``sharded_state_dict()``, as Megatron-LM's ``--ckpt-format torch_dist`` saves: ok) and ``torch_dist_wrong_config``
(shape: the stacked vision layer axis).
It writes ``OUT_DIR/selftest_rank{r}.json`` = ``{"cases": {case: result as above}}`` and ``model_rank{r}.json``.

CPU shims (none changes a name or a shape): ``mcore_cpu.prepare_cpu`` and ``mcore_dist_harness._cpu_shims``
(``Tensor.cuda`` -> identity: ``CLIPViTModel`` puts its position ids on CUDA), and ``CLIPViTModel``'s default
``ln_pre_impl`` becomes megatron's ``WrappedTorchNorm`` (without Transformer Engine the default is
``torch.nn.LayerNorm``, which ``build_module`` cannot construct; same parameter names ``weight`` / ``bias``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mcore_cpu import prepare_cpu  # noqa: E402  (loopback, one thread, torch.cuda.current_device -> "cpu")

torch = prepare_cpu()
import torch.nn.functional as F  # noqa: E402

from mcore_args_harness import args_getter, config_from_args, iteration_dir  # noqa: E402
from mcore_dist_harness import (  # noqa: E402
    CONTENT_METADATA,
    _cpu_shims,
    _die_with_parent,
    _reap_strays,
    spawn_and_join,
)
from megatron_core_harness import padded_vocab  # noqa: E402

TRACKER = "latest_checkpointed_iteration.txt"
ITERATION = 1
MAKE_VOCAB_DIVISIBLE_BY = 128  # Megatron-LM's default

#: The research plan's tiny LLaVA (notes/issue35-plan.md section 7), as transformers 5.24 saves its config.json
#: (only the fields read here).
TINY_LLAVA = {
    "architectures": ["LlavaForConditionalGeneration"],
    "model_type": "llava",
    "text_config": {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "attention_bias": False,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                    "tie_word_embeddings": False},
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 48,
                      "num_hidden_layers": 3, "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
                      "num_channels": 3, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
    "image_token_index": 260,
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "projector_hidden_act": "gelu",
    "multimodal_projector_bias": True,
    "tie_word_embeddings": False,
}


# ---------------------------------------------------------------------------------------------------------------
# The model, from a Hugging Face LLaVA config


def llava_dims(config: dict, vision_layers: int | None = None) -> dict:
    """The sizes and settings megatron-core's LLaVAModel needs, from an HF ``LlavaForConditionalGeneration``
    config (refuses what megatron-core's LLaVA cannot hold)."""
    arch = (config.get("architectures") or [None])[0]
    if config.get("model_type") != "llava" and arch != "LlavaForConditionalGeneration":
        raise SystemExit(f"not a LLaVA config (model_type {config.get('model_type')!r}, architectures {arch!r}); "
                         "LLaVA-NeXT has no megatron-core layout (image_newline)")
    text, vision = config["text_config"], config["vision_config"]
    text_type = text.get("model_type", "llama")
    if text_type not in ("llama", "mistral", "qwen2"):
        raise SystemExit(f"text_config.model_type {text_type!r}: this harness builds Llama / Mistral / Qwen2 only")
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise SystemExit(f"vision_config.model_type {vision.get('model_type')!r}: only CLIP towers are built here")
    if vision.get("num_channels", 3) != 3:
        raise SystemExit("megatron-core's CLIPViTModel has 3 input channels")
    feature = config.get("vision_feature_layer", -2)
    if isinstance(feature, list):
        raise SystemExit("vision_feature_layer is a list: megatron-core's projector takes one layer's features")
    n_vision = vision["num_hidden_layers"]  # every CLIP block, as Megatron-LM's examples build and convert them
    if vision_layers is not None:
        n_vision = vision_layers
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise SystemExit(f"vision_feature_select_strategy {strategy!r}")
    H, nh = text["hidden_size"], text["num_attention_heads"]
    rope = text.get("rope_parameters") or {}
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return dict(
        vocab_size=text["vocab_size"],
        hidden_size=H,
        ffn_hidden_size=text["intermediate_size"],
        num_layers=text["num_hidden_layers"],
        num_attention_heads=nh,
        num_query_groups=text.get("num_key_value_heads") or nh,
        kv_channels=text.get("head_dim") or H // nh,
        norm_epsilon=text.get("rms_norm_eps", 1e-6),
        rotary_base=rope.get("rope_theta", text.get("rope_theta", 10000.0)),
        max_position_embeddings=text.get("max_position_embeddings", 2048),
        add_qkv_bias=text_type == "qwen2" or bool(text.get("attention_bias", False)),
        tied=bool(tied),
        vision_hidden=vision["hidden_size"],
        vision_ffn=vision["intermediate_size"],
        vision_heads=vision["num_attention_heads"],
        vision_layers_hf=vision["num_hidden_layers"],
        vision_layers=n_vision,
        vision_eps=vision.get("layer_norm_eps", 1e-5),
        vision_act=vision.get("hidden_act", "quick_gelu"),
        image_size=vision["image_size"],
        patch_size=vision["patch_size"],
        drop_class_token=strategy == "default",
        projector_bias=bool(config.get("multimodal_projector_bias", True)),
        projector_act=config.get("projector_hidden_act", "gelu"),
        image_token_index=config.get("image_token_index", config.get("image_token_id", -200)),
    )


def megatron_lm_args(dims: dict, tp: int, padded: int) -> argparse.Namespace:
    """The Megatron-LM args of a LLaVA run with this language model (the fields config_from_args reads)."""
    return argparse.Namespace(
        num_layers=dims["num_layers"], hidden_size=dims["hidden_size"], ffn_hidden_size=dims["ffn_hidden_size"],
        num_attention_heads=dims["num_attention_heads"], group_query_attention=True,
        num_query_groups=dims["num_query_groups"], kv_channels=dims["kv_channels"], swiglu=True,
        normalization="RMSNorm", norm_epsilon=dims["norm_epsilon"], add_bias_linear=False,
        add_qkv_bias=dims["add_qkv_bias"], rotary_interleaved=False, apply_residual_connection_post_layernorm=False,
        window_size=None, params_dtype=torch.float32, tensor_model_parallel_size=tp, padded_vocab_size=padded,
        vocab_size=dims["vocab_size"], max_position_embeddings=dims["max_position_embeddings"],
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=dims["rotary_base"], use_rope_scaling=False,
        rotary_seq_len_interpolation_factor=None, untie_embeddings_and_output_weights=not dims["tied"],
        attention_softmax_in_fp32=True, transformer_impl="local")


_PLUMBING = dict(  # CPU / eval settings, as config_from_args sets them for the language model
    use_cpu_initialization=True, perform_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
    masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
    gradient_accumulation_fusion=False, persist_layer_norm=False, sequence_parallel=False,
    params_dtype=torch.float32, pipeline_model_parallel_size=1)


def _activation(name: str):
    from megatron.core.activations import quick_gelu

    acts = {"quick_gelu": quick_gelu, "gelu": F.gelu, "gelu_pytorch_tanh": F.gelu, "relu": F.relu, "silu": F.silu}
    if name not in acts:
        raise SystemExit(f"activation {name!r} is not built by this harness")
    return acts[name]


def build_llava(dims: dict, tp: int, padded: int, seed: int):
    """megatron-core's LLaVAModel for ``dims`` on this rank (one pipeline stage, encoder and decoder)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_mlp_module_spec
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = megatron_lm_args(dims, tp, padded)
    get = args_getter(args, set())
    torch.manual_seed(seed)  # same seed on every rank: CPU init builds each whole weight and keeps this rank's part
    lm = config_from_args(get, perform_initialization=True)
    Hv, nv = dims["vision_hidden"], dims["vision_heads"]
    # Megatron-LM examples/multimodal/config.py get_vision_model_config("clip") and get_vision_projection_config.
    vision = TransformerConfig(
        num_layers=dims["vision_layers"], hidden_size=Hv, ffn_hidden_size=dims["vision_ffn"],
        num_attention_heads=nv, num_query_groups=nv, kv_channels=Hv // nv, normalization="LayerNorm",
        layernorm_epsilon=dims["vision_eps"], gated_linear_unit=False, activation_func=_activation(dims["vision_act"]),
        add_bias_linear=True, add_qkv_bias=True, attention_softmax_in_fp32=True, tensor_model_parallel_size=tp,
        **_PLUMBING)
    vision.vision_model_type = "clip"
    projection = TransformerConfig(
        num_layers=1, hidden_size=dims["hidden_size"], ffn_hidden_size=dims["hidden_size"],
        num_attention_heads=dims["num_attention_heads"], gated_linear_unit=False,
        activation_func=_activation(dims["projector_act"]), add_bias_linear=dims["projector_bias"],
        tensor_model_parallel_size=tp, **_PLUMBING)
    model = LLaVAModel(
        language_transformer_config=lm,
        language_transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        language_vocab_size=padded,
        language_max_sequence_length=dims["max_position_embeddings"],
        vision_transformer_config=vision,
        vision_transformer_layer_spec=get_vit_layer_with_local_spec(),
        drop_vision_class_token=dims["drop_class_token"],
        vision_projection_config=projection,
        vision_projection_layer_spec=get_mlp_module_spec(use_te=False).submodules,
        vision_projection_type="mlp",
        parallel_output=False,
        share_embeddings_and_output_weights=dims["tied"],
        language_position_embedding_type="rope",
        language_rotary_base=dims["rotary_base"],
        img_h=dims["image_size"], img_w=dims["image_size"], patch_dim=dims["patch_size"],
        image_token_index=dims["image_token_index"],
    )
    model.eval()
    return model


def _install_clip_norm() -> None:
    """CLIPViTModel's default ln_pre / ln_post impl -> WrappedTorchNorm (see the module docstring)."""
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    CLIPViTModel.__init__.__defaults__ = tuple(WrappedTorchNorm if d is torch.nn.LayerNorm else d
                                               for d in CLIPViTModel.__init__.__defaults__)


# ---------------------------------------------------------------------------------------------------------------
# Listings and checks


def _shape(v):
    return list(v.shape) if torch.is_tensor(v) else None


def model_listing(model) -> dict:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    listing: dict = {}
    for sh in nested_values(sharded):
        if isinstance(sh, ShardedTensor):  # a stacked layer (or a gate / up half) adds one chunk
            entry = listing.setdefault(sh.key, {"global": list(sh.global_shape), "chunks": []})
            entry["chunks"].append({"offset": list(sh.global_offset), "local": list(sh.local_shape)})
        elif isinstance(sh, ShardedObject):
            listing.setdefault(sh.key, None)
    return {"state_dict": {k: _shape(v) for k, v in model.state_dict().items()},
            "sharded_state_dict": dict(sorted(listing.items()))}


def replica_mismatches(model) -> list[str]:
    """Names of the parameters megatron-core does not split over TP whose values differ between ranks."""
    import torch.distributed as dist

    bad = []
    for name, p in sorted(model.named_parameters()):
        if getattr(p, "tensor_model_parallel", False):
            continue
        ref = p.detach().clone()
        dist.broadcast(ref, src=0)
        same = torch.tensor([int(torch.equal(ref, p.detach()))])
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        if not same.item():
            bad.append(name)
    return bad


def _finish(result: dict) -> dict:
    result["ok"] = not (result["missing"] or result["unexpected"] or result["shape_mismatch"]
                        or result["replica_mismatch"] or result["load_error"]) and result["loaded_equal"]
    return result


def read_torch(path: str) -> dict:
    """A Megatron-LM torch rank file, weights only (its ``args`` are an ``argparse.Namespace``)."""
    torch.serialization.add_safe_globals([argparse.Namespace])
    return torch.load(path, map_location="cpu", weights_only=True)


def check_torch(model, path: str, *, padded: int, args_padded) -> dict:
    """``path`` (a Megatron-LM torch rank file) against ``model``: names, shapes, strict load, replicas."""
    stored = read_torch(path)["model"]
    expected = model.state_dict()
    result = {"format": "torch", "path": path, "padded_vocab": padded, "args_padded_vocab": args_padded,
              "missing": sorted(set(expected) - set(stored)), "unexpected": sorted(set(stored) - set(expected)),
              "unexpected_objects": [], "shape_mismatch": [], "load_error": None, "loaded_equal": False}
    for key in sorted(set(expected) & set(stored)):
        if _shape(expected[key]) != _shape(stored[key]):
            result["shape_mismatch"].append({"key": key, "model": _shape(expected[key]),
                                             "checkpoint": _shape(stored[key])})
    try:
        incompatible = model.load_state_dict(stored, strict=True)
        if incompatible.missing_keys or incompatible.unexpected_keys:
            result["load_error"] = f"incompatible keys: {incompatible}"
    except Exception as e:  # noqa: BLE001  (reported, not raised: the JSON is the result)
        result["load_error"] = f"{type(e).__name__}: {str(e)[:4000]}"
    if result["load_error"] is None:
        after = model.state_dict()
        result["loaded_equal"] = all(torch.equal(after[k], v) for k, v in stored.items() if torch.is_tensor(v))
    result["replica_mismatch"] = replica_mismatches(model)
    return _finish(result)


def _checkpoint_keys(iter_dir: str) -> tuple[dict, set]:
    """The DCP metadata of a torch_dist iteration folder: {tensor key: global shape}, {object keys}."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(iter_dir).read_metadata()
    tensors, objects = {}, set()
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors[key] = list(md.size)
        else:
            objects.add(key)
    return tensors, objects


def check_torch_dist(model, iter_dir: str, *, padded: int, args_padded) -> dict:
    """A torch_dist iteration folder against ``model.sharded_state_dict()``: keys, global shapes, strict load."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.validation import StrictHandling

    ckpt_tensors, ckpt_objects = _checkpoint_keys(iter_dir)
    wanted = model.sharded_state_dict()
    apply_factories(wanted)
    want_tensors, want_objects = {}, set()
    for sh in nested_values(wanted):
        if isinstance(sh, ShardedTensor):
            want_tensors[sh.key] = list(sh.global_shape)
        elif isinstance(sh, ShardedObject):
            want_objects.add(sh.unique_key)
    result = {"format": "torch_dist", "path": iter_dir, "padded_vocab": padded, "args_padded_vocab": args_padded,
              "missing": sorted((set(want_tensors) - set(ckpt_tensors)) | (want_objects - ckpt_objects)),
              "unexpected": sorted(set(ckpt_tensors) - set(want_tensors)),
              "unexpected_objects": sorted(ckpt_objects - want_objects),
              "shape_mismatch": [{"key": k, "model": want_tensors[k], "checkpoint": ckpt_tensors[k]}
                                 for k in sorted(set(want_tensors) & set(ckpt_tensors))
                                 if want_tensors[k] != ckpt_tensors[k]],
              "load_error": None, "loaded_equal": False}
    from megatron.core import parallel_state

    metadata = dict(read_torch(os.path.join(iter_dir, "common.pt")).get("content_metadata") or {})
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if not result["shape_mismatch"]:  # a global shape mismatch makes the load raise deep in DCP; reported above
        try:
            # as Megatron-LM's load_checkpoint: the model's sharded state under "model"
            loaded, ckpt_only, model_only = dist_checkpointing.load(
                {"model": model.sharded_state_dict(metadata=metadata)}, iter_dir, strict=StrictHandling.RETURN_ALL)
            loaded = loaded["model"]
            if model_only:
                result["load_error"] = f"dist_checkpointing.load: the checkpoint lacks {sorted(model_only)}"
            before = {k: v.clone() for k, v in loaded.items() if torch.is_tensor(v)}
            incompatible = model.load_state_dict(loaded, strict=True)
            if incompatible.missing_keys or incompatible.unexpected_keys:
                result["load_error"] = f"incompatible keys: {incompatible}"
            after = model.state_dict()
            result["loaded_equal"] = all(torch.equal(after[k], v) for k, v in before.items())
            result["ckpt_only_keys_reported_by_mcore"] = sorted(ckpt_only)
        except Exception as e:  # noqa: BLE001
            result["load_error"] = f"{type(e).__name__}: {str(e)[:4000]}"
    else:
        result["load_error"] = "not attempted: global shapes differ"
    result["replica_mismatch"] = replica_mismatches(model)
    return _finish(result)


def dist_save(model, ckpt_dir: str) -> None:
    """``dist_checkpointing.save`` of the model, as Megatron-LM's ``--ckpt-format torch_dist`` saves it (fully
    parallel over the data-parallel group); megatron's writer-results Manager is started here, tied to this rank's
    life, and stopped after the save, as ``mcore_dist_harness.run_save`` does -- but forked, not spawned (a spawned
    one re-imports this script, torch and megatron: about 8 s of a 15 s self-test on two busy cores; megatron forks
    its own writer processes from the rank the same way)."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    state = {"checkpoint_version": 3.0, "iteration": ITERATION,
             "model": model.sharded_state_dict(metadata=dict(CONTENT_METADATA, dp_cp_group=dp_cp_group))}
    if dist.get_rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), dp_cp_group, False)
    manager = SyncManager(ctx=multiprocessing.get_context("fork"))
    manager.start(initializer=_die_with_parent)
    try:
        filesystem_async._results_queue = manager.Queue()
        dist_checkpointing.save(state, ckpt_dir, strategy, async_sharded_save=False,
                                validate_access_integrity=True, content_metadata=dict(CONTENT_METADATA))
        dist.barrier()
    finally:
        filesystem_async._results_queue = None
        manager.shutdown()


# ---------------------------------------------------------------------------------------------------------------
# Modes


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def _save_rank_file(folder: str, rank: int, state: dict, args: argparse.Namespace) -> str:
    """Megatron-LM's torch layout: FOLDER/latest_checkpointed_iteration.txt, FOLDER/iter_%07d/mp_rank_TT/..."""
    rank_dir = os.path.join(folder, f"iter_{ITERATION:07d}", f"mp_rank_{rank:02d}")
    os.makedirs(rank_dir, exist_ok=True)
    path = os.path.join(rank_dir, "model_optim_rng.pt")
    torch.save({"model": state, "args": args, "checkpoint_version": 3.0, "iteration": ITERATION}, path)
    with open(os.path.join(folder, TRACKER), "w") as f:
        f.write(str(ITERATION))
    return path


def run_selftest(cli: argparse.Namespace) -> None:
    import torch.distributed as dist

    rank, tp = dist.get_rank(), cli.tp
    dims = llava_dims(cli.hf_config)
    padded = padded_vocab(dims["vocab_size"], MAKE_VOCAB_DIVISIBLE_BY, tp)
    args = megatron_lm_args(dims, tp, padded)
    args.make_vocab_size_divisible_by = MAKE_VOCAB_DIVISIBLE_BY
    source = build_llava(dims, tp, padded, cli.seed)
    with torch.no_grad():  # 1-D parameters start at 0 / 1: give them seeded noise so a value check means something
        gen = torch.Generator().manual_seed(cli.seed + 1)
        for _, p in sorted(source.named_parameters()):
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    reference = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in source.state_dict().items()}
    root = os.path.join(cli.out_dir, "selftest")
    kw = dict(padded=padded, args_padded=padded)
    cases: dict[str, dict] = {}

    def torch_case(name: str, state: dict) -> None:
        path = _save_rank_file(os.path.join(root, name), rank, state, args)
        dist.barrier()
        fresh = build_llava(dims, tp, padded, cli.seed + 2)
        # a different seed: the strict load must replace every weight (a value check would be vacuous otherwise)
        differed = sorted(k for k, v in fresh.state_dict().items() if torch.is_tensor(v) and v.dim() > 1
                          and not torch.equal(v, reference[k]))
        cases[name] = check_torch(fresh, path, **kw)
        cases[name]["weights_differed_before_load"] = len(differed)

    torch_case("clean", reference)
    qkv = "vision_model.decoder.layers.0.self_attention.linear_qkv.weight"
    torch_case("renamed", {(k + "s" if k == qkv else k): v for k, v in reference.items()})
    fc1 = "vision_projection.encoder.linear_fc1.weight"
    whole = [torch.empty_like(reference[fc1]) for _ in range(tp)]
    dist.all_gather(whole, reference[fc1].contiguous())
    torch_case("reshaped", dict(reference, **{fc1: torch.cat(whole, dim=0)}))
    extra = "vision_model.decoder.layers.0.mlp.linear_fc2._extra_state"
    torch_case("dropped_extra_state", {k: v for k, v in reference.items() if k != extra})
    token = reference["vision_model.class_token"]
    torch_case("replica", dict(reference, **{"vision_model.class_token": token + (0.5 if rank == 1 else 0.0)}))
    wrong = build_llava(llava_dims(cli.hf_config, vision_layers=dims["vision_layers"] + 1), tp, padded, cli.seed)
    cases["wrong_config"] = check_torch(wrong, cases["clean"]["path"], **kw)

    if not cli.no_torch_dist:
        folder = os.path.join(root, "torch_dist")
        iter_dir = os.path.join(folder, f"iter_{ITERATION:07d}")
        dist_save(source, iter_dir)
        if rank == 0:
            with open(os.path.join(folder, TRACKER), "w") as f:
                f.write(str(ITERATION))
        dist.barrier()
        fresh = build_llava(dims, tp, padded, cli.seed + 2)
        cases["torch_dist"] = check_torch_dist(fresh, iter_dir, **kw)
        cases["torch_dist"]["values_equal_saved"] = all(
            torch.equal(v, reference[k]) for k, v in fresh.state_dict().items() if torch.is_tensor(v))
        wrong = build_llava(llava_dims(cli.hf_config, vision_layers=dims["vision_layers"] + 1), tp, padded, cli.seed)
        cases["torch_dist_wrong_config"] = check_torch_dist(wrong, iter_dir, **kw)

    for case in cases.values():
        case.update(rank=rank, tp=tp, dims=dims)
    _write_json(os.path.join(cli.out_dir, f"model_rank{rank}.json"), model_listing(source))
    _write_json(os.path.join(cli.out_dir, f"selftest_rank{rank}.json"), {"cases": cases})
    summary = {name: c["ok"] for name, c in cases.items()}
    print(f"rank {rank}: selftest {summary}", flush=True)
    dist.barrier()


def run_load(cli: argparse.Namespace) -> None:
    import torch.distributed as dist

    rank, tp = dist.get_rank(), cli.tp
    dims = llava_dims(cli.hf_config, vision_layers=cli.vision_layers)
    iter_dir = iteration_dir(cli.ckpt_dir)
    fmt = cli.format
    if fmt == "auto":
        fmt = "torch_dist" if os.path.exists(os.path.join(iter_dir, ".metadata")) else "torch"
    if fmt == "torch":
        rank_file = os.path.join(iter_dir, f"mp_rank_{rank:02d}", "model_optim_rng.pt")
        if not os.path.exists(rank_file):
            found = sorted(os.listdir(iter_dir)) if os.path.isdir(iter_dir) else []
            raise SystemExit(f"rank {rank}: no {rank_file} (the folder holds {found}; PP > 1 is not built here)")
        args = read_torch(rank_file).get("args")
    else:
        args = read_torch(os.path.join(iter_dir, "common.pt")).get("args")
    divisor = getattr(args, "make_vocab_size_divisible_by", None) or MAKE_VOCAB_DIVISIBLE_BY
    padded = padded_vocab(dims["vocab_size"], divisor, tp)  # Megatron-LM recomputes it for the running TP
    args_padded = getattr(args, "padded_vocab_size", None)
    model = build_llava(dims, tp, padded, cli.seed)
    listing = model_listing(model)
    kw = dict(padded=padded, args_padded=args_padded)
    if fmt == "torch":
        result = check_torch(model, rank_file, **kw)
    else:
        result = check_torch_dist(model, iter_dir, **kw)
    result.update(rank=rank, tp=tp, dims=dims)
    if args_padded is not None and args_padded != padded:
        result["load_error"] = (result["load_error"] or "") + (
            f" args.padded_vocab_size {args_padded} != Megatron-LM's padding of {dims['vocab_size']} "
            f"(divisor {divisor}, tp {tp}): {padded}")
        result["ok"] = False
    _write_json(os.path.join(cli.out_dir, f"model_rank{rank}.json"), listing)
    _write_json(os.path.join(cli.out_dir, f"result_rank{rank}.json"), result)
    print(f"rank {rank}: {fmt} ok={result['ok']} missing={len(result['missing'])} "
          f"unexpected={len(result['unexpected'])} shape={len(result['shape_mismatch'])} "
          f"load_error={bool(result['load_error'])}", flush=True)
    dist.barrier()


def worker(local_rank: int, cli: argparse.Namespace, init_method: str) -> None:
    import torch.distributed as dist

    _die_with_parent()
    _cpu_shims()
    _install_clip_norm()
    import logging

    logging.getLogger("megatron").setLevel(logging.ERROR)  # "LLaVA is work in progress", _extra_state notes
    dist.init_process_group(backend="gloo", init_method=init_method, rank=local_rank, world_size=cli.tp)
    try:
        from megatron.core import parallel_state, tensor_parallel

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=cli.tp, pipeline_model_parallel_size=1)
        # The CUDA seed helper (model_parallel_cuda_manual_seed) needs a GPU; the inference tracker does not.
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
        (run_selftest if cli.command == "selftest" else run_load)(cli)
        parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    # Done, results written and closed: skip the interpreter teardown of torch + megatron (about 4 s of the run on
    # two busy cores).  A failure never gets here: it raises, and mp.spawn reports the traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    load = sub.add_parser("load", help="check a Megatron LLaVA checkpoint against megatron-core's LLaVAModel")
    load.add_argument("ckpt_dir", help="the folder holding latest_checkpointed_iteration.txt")
    load.add_argument("out_dir", help="where result_rank{r}.json and model_rank{r}.json go")
    load.add_argument("--config", help="the HF LLaVA config.json (default: CKPT_DIR/config.json)")
    load.add_argument("--format", choices=("auto", "torch", "torch_dist"), default="auto")
    load.add_argument("--vision-layers", type=int, help="vision blocks to build (default: vision_config.num_hidden_layers)")
    selftest = sub.add_parser("selftest", help="check the checks on megatron-core's own state dicts")
    selftest.add_argument("out_dir")
    selftest.add_argument("--config", help="an HF LLaVA config.json (default: the built-in tiny LLaVA)")
    selftest.add_argument("--no-torch-dist", action="store_true", help="skip the dist_checkpointing cases")
    for p in (load, selftest):
        p.add_argument("--tp", type=int, default=2)
        p.add_argument("--seed", type=int, default=1234)
    cli = parser.parse_args()
    if cli.tp < 1:
        parser.error("--tp must be >= 1")
    for attr in ("ckpt_dir", "out_dir", "config"):
        if getattr(cli, attr, None):
            setattr(cli, attr, os.path.abspath(getattr(cli, attr)))
    if cli.command == "load" and not cli.config:
        cli.config = os.path.join(cli.ckpt_dir, "config.json")
    if cli.config:
        with open(cli.config) as f:
            cli.hf_config = json.load(f)
    else:
        cli.hf_config = TINY_LLAVA
    llava_dims(cli.hf_config, getattr(cli, "vision_layers", None))  # refuse an unsupported config before spawning
    os.makedirs(cli.out_dir, exist_ok=True)
    if cli.command == "selftest":
        shutil.rmtree(os.path.join(cli.out_dir, "selftest"), ignore_errors=True)

    import tempfile

    import torch.multiprocessing as mp

    try:  # orphans below this process re-parent to it (see mcore_dist_harness._reap_strays)
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass
    try:
        with tempfile.TemporaryDirectory(prefix="mcore_llava_harness_") as tmp:
            spawn_and_join(mp, worker, (cli, "file://" + os.path.join(tmp, "store")), cli.tp)
    finally:
        from multiprocessing import resource_tracker

        tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
        strays = _reap_strays({tracker} if tracker else set())
        if strays:
            print(f"mcore_llava_harness: killed stray processes {strays}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
