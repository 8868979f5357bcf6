"""Regenerate tests/fixtures/maxtext/ with MaxText itself (the oracle for reshard's `maxtext` layout).

Two interpreters (see README.md beside this file):
- the driver runs under Python 3.11 with torch + transformers + safetensors (the repository's environment): it makes
  the tiny Hugging Face models and the transformers logits, and assembles the fixture folders;
- every MaxText step runs as a subprocess under the MaxText venv (Python 3.12, maxtext 0.2.5 from PyPI):
  `to_maxtext`, `to_huggingface`, MaxText's forward, MaxText's trainer, and Orbax saves as MaxText's checkpointing
  does. Those subprocesses call this same file with the hidden first argument `mt` (no torch imported there).

usage: python scripts/maxtext_fixtures/make_fixtures.py [--mt-python /work/venvs/maxtext/bin/python]
           [--out tests/fixtures/maxtext] [--work /tmp/maxtext_fixtures_work] [CASE ...]
CASE: llama31 qwen3 mixtral gemma2 deepseek3 train_default orbax_variants (default: all).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENS = [1, 17, 42, 99, 7, 200, 3, 55]
MT_VERSION = "0.2.5"
OLD_VERSION, OLD_COMMIT = "0.2.4", "e591f30"  # only where 0.2.5 fails (see CASES["mixtral"])
DEVICES = 2  # simulated CPU devices for to_maxtext: every array is chunked in 2 (axis 0 when it divides)

# ---------------------------------------------------------------------------------------------------------------
# The tiny models: hidden 32, 4 query heads x head_dim 12 (q 48 != hidden), 2 kv heads, ffn 40, 3 layers (Gemma 2:
# 4 HF layers = 2 MaxText pairs), vocab 256 (Gemma 2 MaxText: 320). 1/sqrt(12) and sqrt(32) are not powers of two,
# so MaxText's bf16 q pre-scale and Gemma embedding scale round.
COMMON = dict(vocab_size=256, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=12, max_position_embeddings=131072, hidden_act="silu")
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
CASES = {
    # llama3.1-*: interleaved RoPE rows (LLaMARotaryEmbedding, llama3 scaling 8/1/4/8192), q pre-scaled
    "llama31": dict(arch="LlamaForCausalLM", mt="llama3.1-8b",
                    hf=dict(COMMON, model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                            tie_word_embeddings=False),
                    extra=["rope_max_timescale=500000", "normalization_layer_epsilon=1e-5"]),
    # qwen3-*: half-split RoPE, q/k RMSNorm, tied (no logits_dense), no q pre-scale
    "qwen3": dict(arch="Qwen3ForCausalLM", mt="qwen3-0.6b",
                  hf=dict(COMMON, model_type="qwen3", rms_norm_eps=1e-6, rope_theta=1000000.0,
                          tie_word_embeddings=True),
                  extra=["rope_max_timescale=1000000", "normalization_layer_epsilon=1e-6"]),
    # mixtral-*: experts [E, (L,) H, F]; MaxText's HF shape table needs head_dim = hidden / heads (8 here)
    "mixtral": dict(arch="MixtralForCausalLM", mt="mixtral-8x7b",
                    hf=dict(COMMON, model_type="mixtral", head_dim=8, intermediate_size=24, rms_norm_eps=1e-5,
                            rope_theta=1000000.0, num_local_experts=4, num_experts_per_tok=2,
                            tie_word_embeddings=False, sliding_window=None),
                    extra=["rope_max_timescale=1000000", "normalization_layer_epsilon=1e-5", "num_experts=4",
                           "num_experts_per_tok=2", "base_moe_mlp_dim=24", "sparse_matmul=False", "megablox=False",
                           "capacity_factor=-1"],
                    # maxtext 0.2.5's to_maxtext stacks the scanned MoeBlock_0.gate.kernel on axis 0 ([L, H, E]
                    # instead of [H, L, E]: `is_unscanned_moe` in _build_single_axis_stacked_tensor matches every
                    # MoeBlock key) and fails with a shape mismatch; MaxText 0.2.4's source (e591f30) converts it
                    old_src_for=("to_maxtext_scan",)),
    # gemma2-*: MaxText layer i = HF layers 2i (local) and 2i+1 (global); norms 1 + w; embedding * sqrt(H), padded
    # to MaxText's vocab 320; q pre-scaled by 1/sqrt(query_pre_attn_scalar = head_dim); tied
    "gemma2": dict(arch="Gemma2ForCausalLM", mt="gemma2-2b",
                   hf=dict(COMMON, model_type="gemma2", num_hidden_layers=4, rms_norm_eps=1e-6, rope_theta=10000.0,
                           hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                           query_pre_attn_scalar=12, sliding_window=4096, final_logit_softcapping=30.0,
                           attn_logit_softcapping=50.0, tie_word_embeddings=True),
                   tweaks={"base_num_decoder_layers": 2, "vocab_size": 320},
                   extra=["normalization_layer_epsilon=1e-6"]),
    # deepseek3-*: MLA with q LoRA, 1 dense layer then 2 MoE layers (sigmoid router + bias, 1 shared expert);
    # MaxText stacks dense_layers / moe_layers; YaRN as MaxText's deepseek3 config (factor 40, 4096, beta 32/1)
    "deepseek3": dict(arch="DeepseekV3ForCausalLM", mt="deepseek3-671b",
                      hf=dict(COMMON, model_type="deepseek_v3", num_key_value_heads=4, head_dim=8,
                              moe_intermediate_size=16, first_k_dense_replace=1, n_routed_experts=4,
                              n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=24,
                              kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                              routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6,
                              rope_theta=10000.0, max_position_embeddings=163840, rope_scaling=DEEPSEEK_YARN,
                              tie_word_embeddings=False, num_nextn_predict_layers=0),
                      tweaks={"head_dim": 128},
                      extra=["first_num_dense_layers=1", "base_moe_mlp_dim=16", "num_experts=4",
                             "num_experts_per_tok=2", "shared_experts=1", "q_lora_rank=24", "kv_lora_rank=16",
                             "qk_nope_head_dim=16", "qk_rope_head_dim=8", "v_head_dim=12", "sparse_matmul=False",
                             "megablox=False"],
                      # maxtext 0.2.5 made the DeepSeek router bias an `MoEBiasVar` (its own collection) while its
                      # to_maxtext param map still names `params-...-MoeBlock_0-gate-bias`: "maxtext_state_dict must
                      # be a subset of flattened param_map"; 0.2.4's source converts it (0.2.5 restores that form)
                      old_src_for=("to_maxtext_scan", "to_maxtext_unscan")),
}
FAMILIES = list(CASES)

# MaxText's trainer, model_name=default (the llama2 decoder block), fp32, synthetic data
TRAIN_DIMS = dict(base_emb_dim=32, base_num_query_heads=4, base_num_kv_heads=2, base_mlp_dim=40,
                  base_num_decoder_layers=3, head_dim=8, vocab_size=256)
TRAIN_HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
                   "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 3, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "silu", "max_position_embeddings": 2048,
                   "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False,
                   "attention_bias": False, "mlp_bias": False}
TRAIN_STEPS = 2


def maxtext_overrides(case: dict) -> list[str]:
    """MaxText command-line overrides matching the tiny HF config (plus the family's extras)."""
    cfg = case["hf"]
    values = {"base_emb_dim": cfg["hidden_size"], "base_num_query_heads": cfg["num_attention_heads"],
              "base_num_kv_heads": cfg["num_key_value_heads"], "base_mlp_dim": cfg["intermediate_size"],
              "base_num_decoder_layers": cfg["num_hidden_layers"], "head_dim": cfg.get("head_dim", 128),
              "vocab_size": cfg["vocab_size"], **case.get("tweaks", {})}
    return [f"{k}={v}" for k, v in values.items()] + case["extra"]


# ===============================================================================================================
# MaxText side (Python 3.12 venv): `python make_fixtures.py mt OP JSON_ARGS`
# ===============================================================================================================

def _mt_env(devices: int = 1) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"


def _base_yml() -> str:
    import maxtext
    return os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")


def _patch_hf_config(model_name: str, hf_dir: str, *modules) -> None:
    """MaxText's converters take the HF architecture from a fixed table of full-size configs
    (HF_MODEL_CONFIGS[model_name]); put the tiny model's own config.json there. Nothing else is changed."""
    import transformers
    from maxtext.checkpoint_conversion.utils import hf_model_configs
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = transformers.AutoConfig.for_model(**json.load(f))
    hf_model_configs.HF_MODEL_CONFIGS[model_name] = cfg
    for module in modules:
        module.HF_MODEL_CONFIGS[model_name] = cfg


COMMON_MT = ["override_model_config=True", "hardware=cpu", "skip_jax_distributed_system=True", "attention=dot_product"]


def mt_to_maxtext(a: dict) -> None:
    _mt_env(DEVICES)
    import jax
    jax.config.update("jax_platforms", "cpu")
    from maxtext.checkpoint_conversion import to_maxtext
    _patch_hf_config(a["model_name"], a["hf_dir"], to_maxtext)
    args = ["to_maxtext", _base_yml(), f"base_output_directory={a['out']}", f"scan_layers={a['scan']}",
            "run_name=convert", "checkpoint_storage_use_zarr3=True", "checkpoint_storage_use_ocdbt=True",
            f"model_name={a['model_name']}", *COMMON_MT, *a["overrides"]]
    to_maxtext.main(args=args, lazy_load_tensors=True, hf_model_path=a["hf_dir"], save_dtype="bfloat16",
                    simulated_cpu_devices_count=DEVICES)


def mt_to_huggingface(a: dict) -> None:
    _mt_env(1)
    from maxtext.checkpoint_conversion import to_huggingface
    _patch_hf_config(a["model_name"], a["hf_dir"], to_huggingface)

    class NoTokenizer:  # the converter copies a tokenizer from the Hub; a tiny model has none
        def save_pretrained(self, *args, **kwargs):
            return None

    loader = type("NoTokenizerLoader", (), {"from_pretrained": staticmethod(lambda *a, **k: NoTokenizer())})
    to_huggingface.AutoTokenizer = to_huggingface.AutoProcessor = loader
    argv = ["to_huggingface", _base_yml(), f"load_parameters_path={a['items']}", f"base_output_directory={a['out']}",
            f"scan_layers={a['scan']}", "weight_dtype=bfloat16", "run_name=back", f"model_name={a['model_name']}",
            *COMMON_MT, *a["overrides"]]
    from absl import flags
    flags.FLAGS(argv[:1], known_only=True)
    to_huggingface.main(argv)


def mt_forward(a: dict) -> None:
    """MaxText's own forward (model_creation_utils.from_pretrained, as MaxText's forward_pass_logit_checker does),
    fp32 weights and activations, on the checkpoint at a['items']; saves the logits [T, V_maxtext] as .npy."""
    _mt_env(1)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from maxtext.common.common_types import MODEL_MODE_TRAIN
    from maxtext.configs import pyconfig
    from maxtext.utils import maxtext_utils, model_creation_utils
    argv = [None, _base_yml(), f"model_name={a['model_name']}", *a["overrides"],
            f"load_parameters_path={a['items']}", f"scan_layers={a['scan']}", *COMMON_MT, "dtype=float32",
            "weight_dtype=float32", "matmul_precision=highest", "per_device_batch_size=1",
            f"max_target_length={len(TOKENS)}", "max_prefill_predict_length=4", "enable_checkpointing=True",
            "async_checkpointing=False", "run_name=fwd", f"base_output_directory={a['scratch']}",
            "enable_dropout=False"]
    config = pyconfig.initialize(argv)
    mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(config), config.mesh_axes)
    model = model_creation_utils.from_pretrained(config, mesh=mesh, model_mode=MODEL_MODE_TRAIN)
    ids = jnp.asarray([TOKENS], dtype=jnp.int32)
    pos = jnp.arange(len(TOKENS), dtype=jnp.int32)[None]
    seg = jnp.ones((1, len(TOKENS)), dtype=jnp.int32)
    logits = model(decoder_input_tokens=ids, decoder_positions=pos, decoder_segment_ids=seg, enable_dropout=False)
    np.save(a["save"], np.asarray(logits, dtype=np.float32)[0])


def mt_train(a: dict) -> None:
    """MaxText's trainer (maxtext.trainers.pre_train.train), run as `python -m` would."""
    _mt_env(1)
    import runpy
    tok = os.path.join(os.path.dirname(_base_yml()), "..", "assets", "tokenizers", "tokenizer.llama2")
    sys.argv = ["train", _base_yml(), f"base_output_directory={a['out']}", f"run_name={a['run_name']}",
                "model_name=default", *a["overrides"], "per_device_batch_size=1", "max_target_length=32",
                "dataset_type=synthetic", f"steps={TRAIN_STEPS}", "enable_checkpointing=True", "checkpoint_period=1",
                "async_checkpointing=False", f"scan_layers={a['scan']}", f"tokenizer_path={os.path.normpath(tok)}",
                "enable_goodput_recording=False", "enable_checkpoint_cloud_logger=False", "monitor_goodput=False",
                *COMMON_MT]
    runpy.run_module("maxtext.trainers.pre_train.train", run_name="__main__")


ORBAX_DIMS = dict(V=256, H=32, L=3, NH=4, NKV=2, HD=8, F=40)


def mt_orbax_save(a: dict) -> None:
    """A MaxText-shaped scanned Llama tree (bf16, position-coded values) saved the way MaxText's checkpointing.py
    saves (CheckpointManager(item_names=("items",)), PyTreeCheckpointHandler(use_ocdbt, use_zarr3), 2 GiB
    chunk_byte_size, custom_metadata scan_layers), on 2 devices sharded on the 'embed' axis (fsdp)."""
    _mt_env(2)
    import jax
    import ml_dtypes
    import numpy as np
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.checkpoint_managers import preservation_policy as pp
    from orbax.checkpoint._src.checkpoint_managers import save_decision_policy as sdp
    from safetensors.numpy import save_file
    d = ORBAX_DIMS
    layer = {"self_attention": {"query": {"kernel": (d["H"], d["NH"], d["HD"])},
                                "key": {"kernel": (d["H"], d["NKV"], d["HD"])},
                                "value": {"kernel": (d["H"], d["NKV"], d["HD"])},
                                "out": {"kernel": (d["NH"], d["HD"], d["H"])}},
             "mlp": {"wi_0": {"kernel": (d["H"], d["F"])}, "wi_1": {"kernel": (d["H"], d["F"])},
                     "wo": {"kernel": (d["F"], d["H"])}},
             "pre_self_attention_layer_norm": {"scale": (d["H"],)},
             "post_self_attention_layer_norm": {"scale": (d["H"],)}}

    def stacked(node):
        if isinstance(node, dict):
            return {k: stacked(v) for k, v in node.items()}
        return node[:1] + (d["L"],) + node[1:]  # param_scan_axis = 1

    shapes = {"token_embedder": {"embedding": (d["V"], d["H"])},
              "decoder": {"decoder_norm": {"scale": (d["H"],)}, "logits_dense": {"kernel": (d["H"], d["V"])},
                          "layers": stacked(layer)}}
    flat = {}

    def values(node, path=()):
        if isinstance(node, dict):
            return {k: values(v, path + (k,)) for k, v in node.items()}
        seed = sum(map(ord, "/".join(path))) % 97
        n = int(np.prod(node))
        arr = ((seed + np.arange(n) % 251) / 256.0).astype(np.float32).reshape(node).astype(ml_dtypes.bfloat16)
        flat["params.params." + ".".join(path)] = arr.astype(np.float32)  # exact (bf16 -> f32)
        return arr

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))

    def shard(node, path=()):
        if isinstance(node, dict):
            return {k: shard(v, path + (k,)) for k, v in node.items()}
        ax = node.ndim - 1 if ("out" in path or path[-2:] == ("wo", "kernel")) else (1 if "embedding" in path else 0)
        spec = [None] * node.ndim
        if node.shape[ax] % 2 == 0:
            spec[ax] = "fsdp"
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        return jax.make_array_from_callback(node.shape, sharding, lambda idx: node[idx])

    state = {"step": np.int32(7), "params": {"params": shard(values(shapes))}}
    for ocdbt in (True, False):
        for zarr3 in (True, False):
            out = os.path.join(a["out"], f"{'ocdbt' if ocdbt else 'file'}_{'zarr3' if zarr3 else 'zarr2'}")
            manager = ocp.CheckpointManager(
                out, item_names=("items",),
                item_handlers={"items": ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3,
                                                                    save_concurrent_gb=96, restore_concurrent_gb=96)},
                options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False,
                                                     save_decision_policy=sdp.FixedIntervalPolicy(interval=1),
                                                     preservation_policy=pp.LatestN(10)))
            chunk = 2 * 1024**3
            args = ocp.args.PyTreeSave(item=state, ocdbt_target_data_file_size=chunk,
                                       save_args=jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=chunk), state))
            manager.save(7, args=ocp.args.Composite(items=args), force=True, custom_metadata={"scan_layers": True})
            manager.wait_until_finished()
            manager.close()
    save_file(flat, os.path.join(a["out"], "values.safetensors"),
              metadata={"dtype": "bfloat16", "note": "saved bf16 values widened to float32 (exact)",
                        "jax": jax.__version__, "orbax-checkpoint": ocp.__version__})


MT_OPS = {"to_maxtext": mt_to_maxtext, "to_huggingface": mt_to_huggingface, "forward": mt_forward,
          "train": mt_train, "orbax_save": mt_orbax_save}


# ===============================================================================================================
# Driver side (Python 3.11 with torch + transformers)
# ===============================================================================================================

def run_mt(mt_python: str, op: str, log: str, src: str | None = None, **kwargs) -> None:
    """One MaxText step in its own process (MaxText keeps global state: jax device count, absl flags); `src`: a
    MaxText source folder put first on PYTHONPATH instead of the venv's installed maxtext."""
    env = dict(os.environ, DECOUPLE_GCLOUD="TRUE", JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("PYTHONPATH", None)
    if src:
        env["PYTHONPATH"] = src
    with open(log, "w") as f:
        rc = subprocess.run([mt_python, os.path.abspath(__file__), "mt", op, json.dumps(kwargs)], stdout=f,
                            stderr=subprocess.STDOUT, env=env, cwd=os.path.dirname(log)).returncode
    if rc != 0:
        raise SystemExit(f"MaxText step {op} failed (exit {rc}); log: {log}")
    print(f"  {op} {kwargs.get('scan', '')} ok", flush=True)


def make_hf(case: dict, folder: str):
    """The tiny HF model (bf16, seed 0, seeded noise on every 1-D parameter and on the router bias buffer) and the
    transformers logits (fp32 forward of the bf16 weights) for TOKENS."""
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**case["hf"])
    config.architectures = [case["arch"]]
    model = getattr(transformers, case["arch"])(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if p.ndim == 1 and p.is_floating_point() and (name.endswith("weight") or "correction_bias" in name):
                base = 1.0 if "norm" in name else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen).to(p.dtype))
    model.save_pretrained(folder, safe_serialization=True)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(folder, extra)):
            os.remove(os.path.join(folder, extra))
    return hf_logits(folder, case["arch"])


def hf_logits(folder: str, arch: str):
    import torch
    import transformers
    model = getattr(transformers, arch).from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].float().numpy()


def copy_tree(src: str, dst: str, skip=()) -> None:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*skip) if skip else None)


def diff(a, b) -> float:
    n = min(a.shape[-1], b.shape[-1])
    return float(abs(a[:, :n] - b[:, :n]).max())


def make_family(name: str, out: str, work: str, mt_python: str, old_src: str) -> dict:
    import numpy as np
    from safetensors.numpy import save_file
    case = CASES[name]
    w = os.path.join(work, name)
    shutil.rmtree(w, ignore_errors=True)
    os.makedirs(w)
    fx = os.path.join(out, name)
    shutil.rmtree(fx, ignore_errors=True)
    os.makedirs(fx)
    hf_dir = os.path.join(fx, "hf")
    ref = make_hf(case, hf_dir)
    overrides = maxtext_overrides(case)
    logits = {"input_ids": np.asarray([TOKENS], dtype=np.int64), "transformers": ref}
    results = {}
    made_by = {}
    for scan in (True, False):
        tag = "scan" if scan else "unscan"
        conv = os.path.join(w, f"conv_{tag}")
        def src_for(step: str, made: str) -> str | None:
            if step not in case.get("old_src_for", ()):
                return None
            made_by[made] = f"MaxText {OLD_VERSION} source ({OLD_COMMIT}) {step}"
            return old_src

        run_mt(mt_python, "to_maxtext", os.path.join(w, f"to_maxtext_{tag}.log"),
               src=src_for(f"to_maxtext_{tag}", f"maxtext_{tag}"),
               hf_dir=os.path.abspath(hf_dir),
               model_name=case["mt"], out=conv, scan=scan, overrides=overrides)
        copy_tree(os.path.join(conv, "0"), os.path.join(fx, f"maxtext_{tag}", "0"))
        items = os.path.abspath(os.path.join(fx, f"maxtext_{tag}", "0", "items"))
        back = os.path.join(w, f"back_{tag}")
        run_mt(mt_python, "to_huggingface", os.path.join(w, f"to_huggingface_{tag}.log"),
               src=src_for(f"to_huggingface_{tag}", f"to_hf_{tag}"), hf_dir=os.path.abspath(hf_dir), model_name=case["mt"], items=items, out=back, scan=scan,
               overrides=overrides)
        os.makedirs(os.path.join(fx, f"to_hf_{tag}"))
        for f in sorted(os.listdir(back)):
            if f.endswith((".safetensors", ".json")) and "token" not in f:
                shutil.copy(os.path.join(back, f), os.path.join(fx, f"to_hf_{tag}", f))
        npy = os.path.join(w, f"maxtext_{tag}.npy")
        run_mt(mt_python, "forward", os.path.join(w, f"forward_{tag}.log"),
               src=src_for(f"forward_{tag}", f"logits maxtext_{tag}"), model_name=case["mt"],
               overrides=overrides, items=items, scan=scan, scratch=os.path.join(w, "fwd"), save=npy)
        logits[f"maxtext_{tag}"] = np.load(npy)
        back_logits = hf_logits(os.path.join(fx, f"to_hf_{tag}"), case["arch"])
        results[tag] = {
            "max_abs(maxtext forward - transformers on hf/)": diff(logits[f"maxtext_{tag}"], ref),
            "max_abs(maxtext forward - transformers on to_hf)": diff(logits[f"maxtext_{tag}"], back_logits),
            "argmax_equal": bool((logits[f"maxtext_{tag}"][:, :ref.shape[1]].argmax(-1) == ref.argmax(-1)).all()),
        }
    results["max_abs_logit"] = float(abs(ref).max())
    save_file(logits, os.path.join(fx, "logits.safetensors"),
              metadata={"tokens": json.dumps(TOKENS), "maxtext": MT_VERSION})
    meta = {"case": name, "hf_architecture": case["arch"], "maxtext_version": MT_VERSION,
            "maxtext_model_name": case["mt"], "maxtext_overrides": overrides,
            "to_maxtext": {"lazy_load_tensors": True, "save_dtype": "bfloat16", "simulated_cpu_devices": DEVICES,
                           "checkpoint_storage_use_ocdbt": True, "checkpoint_storage_use_zarr3": True},
            "to_huggingface": {"weight_dtype": "bfloat16"},
            "forward": {"dtype": "float32", "weight_dtype": "float32", "matmul_precision": "highest",
                        "tokens": TOKENS},
            "made_by_other_version": made_by, "results": results}
    with open(os.path.join(fx, "maxtext.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return results


def make_train(out: str, work: str, mt_python: str) -> dict:
    import numpy as np
    from safetensors.numpy import save_file
    w = os.path.join(work, "train_default")
    shutil.rmtree(w, ignore_errors=True)
    os.makedirs(w)
    fx = os.path.join(out, "train_default")
    shutil.rmtree(fx, ignore_errors=True)
    os.makedirs(fx)
    overrides = [f"{k}={v}" for k, v in TRAIN_DIMS.items()]
    logits = {"input_ids": np.asarray([TOKENS], dtype=np.int64)}
    last = TRAIN_STEPS - 1
    for scan in (True, False):
        tag = "scan" if scan else "unscan"
        run_mt(mt_python, "train", os.path.join(w, f"train_{tag}.log"), out=w, run_name=f"t_{tag}", scan=scan,
               overrides=overrides)
        src = os.path.join(w, f"t_{tag}", "checkpoints", str(last))
        copy_tree(src, os.path.join(fx, tag, "checkpoints", str(last)))
        items = os.path.abspath(os.path.join(fx, tag, "checkpoints", str(last), "items"))
        npy = os.path.join(w, f"maxtext_{tag}.npy")
        run_mt(mt_python, "forward", os.path.join(w, f"forward_{tag}.log"), model_name="default",
               overrides=overrides, items=items, scan=scan, scratch=os.path.join(w, "fwd"), save=npy)
        logits[f"maxtext_{tag}"] = np.load(npy)
    save_file(logits, os.path.join(fx, "logits.safetensors"),
              metadata={"tokens": json.dumps(TOKENS), "maxtext": MT_VERSION})
    with open(os.path.join(fx, "tiny_default_config.json"), "w") as f:
        json.dump(TRAIN_HF_CONFIG, f, indent=1)
    meta = {"case": "train_default", "maxtext_version": MT_VERSION, "maxtext_model_name": "default",
            "maxtext_overrides": overrides, "steps": TRAIN_STEPS, "kept_step": last,
            "train": "python -m maxtext.trainers.pre_train.train <maxtext>/configs/base.yml model_name=default "
                     + " ".join(overrides) + " per_device_batch_size=1 max_target_length=32 dataset_type=synthetic "
                     f"steps={TRAIN_STEPS} enable_checkpointing=True checkpoint_period=1 async_checkpointing=False "
                     "scan_layers=True|False tokenizer_path=<maxtext>/assets/tokenizers/tokenizer.llama2 "
                     "enable_goodput_recording=False enable_checkpoint_cloud_logger=False monitor_goodput=False "
                     "hardware=cpu skip_jax_distributed_system=True attention=dot_product",
            "forward": {"dtype": "float32", "weight_dtype": "float32", "matmul_precision": "highest",
                        "tokens": TOKENS},
            "results": {"max_abs_logit_scan": float(abs(logits["maxtext_scan"]).max()),
                        "max_abs_logit_unscan": float(abs(logits["maxtext_unscan"]).max()),
                        "note": "the scan and unscan runs start from different random initialisations"}}
    with open(os.path.join(fx, "maxtext.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta["results"]


def make_orbax_variants(out: str, work: str, mt_python: str) -> dict:
    w = os.path.join(work, "orbax_variants")
    shutil.rmtree(w, ignore_errors=True)
    os.makedirs(w)
    run_mt(mt_python, "orbax_save", os.path.join(w, "orbax_save.log"), out=os.path.join(w, "out"))
    fx = os.path.join(out, "orbax_variants")
    copy_tree(os.path.join(w, "out"), fx)
    with open(os.path.join(fx, "maxtext.json"), "w") as f:
        json.dump({"case": "orbax_variants", "dims": ORBAX_DIMS, "devices": 2, "step": 7,
                   "variants": {"ocdbt_zarr3": "use_ocdbt=True use_zarr3=True (MaxText's default)",
                                "ocdbt_zarr2": "use_ocdbt=True use_zarr3=False",
                                "file_zarr3": "use_ocdbt=False use_zarr3=True",
                                "file_zarr2": "use_ocdbt=False use_zarr3=False"},
                   "oracle": "values.safetensors (float32 widening of the saved bf16 values, keyed by storage name)"},
                  f, indent=1)
    return {}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "mt":
        MT_OPS[sys.argv[2]](json.loads(sys.argv[3]))
        return
    root = os.path.dirname(os.path.dirname(HERE))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mt-python", default="/work/venvs/maxtext/bin/python")
    p.add_argument("--out", default=os.path.join(root, "tests", "fixtures", "maxtext"))
    p.add_argument("--work", default="/tmp/maxtext_fixtures_work")
    p.add_argument("--mt-old-src", default="/work/venvs/maxtext-0.2.4-src/src",
                   help=f"MaxText {OLD_VERSION} source (the src/ folder of commit {OLD_COMMIT}), for 0.2.5's failures")
    p.add_argument("cases", nargs="*", default=FAMILIES + ["train_default", "orbax_variants"])
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    for name in a.cases:
        print(name, flush=True)
        if name in CASES:
            res = make_family(name, a.out, a.work, a.mt_python, a.mt_old_src)
        elif name == "train_default":
            res = make_train(a.out, a.work, a.mt_python)
        elif name == "orbax_variants":
            res = make_orbax_variants(a.out, a.work, a.mt_python)
        else:
            raise SystemExit(f"unknown case {name!r}; choose from {FAMILIES + ['train_default', 'orbax_variants']}")
        print(name, json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
