"""Config defaults as data (issue 42, item 1): every default a mapping file states is its transformers config class's
own (checked against the class, not against reshard's table), and a sparse config.json, spelled as the Hub
releases leave keys to those classes, means to reshard what it means to transformers: converted outputs compute
transformers' logits, ``verify`` tells a copy that writes another RoPE base apart, and real-size sparse copies of
Gemma-3-12b and LLaVA-1.5-7b plan with transformers' dims."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest
import torch

import vlm_cases
from helpers import run_cli
from reshard.config_defaults import vlm_defaults, with_defaults
from reshard.errors import MappingError
from reshard.layouts.hf_config import read_meaning
from reshard.mapping import load_shipped, parse_family, shipped_mapping_names, shipped_mapping_text
from reshard.mapping_vlm import family_for_architecture, flat_view, vlm_templates
from sparse_checkpoints import _sparse_safetensors

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")


def stated_tables() -> dict[str, dict]:
    """model_type -> the defaults every shipped mapping file states for it (a model type stated twice must agree)."""
    found: dict[str, dict] = {}
    tables = [(arch.model_type, arch.defaults) for name in shipped_mapping_names()
              for _, arch in load_shipped(name).config.architectures if arch.defaults]
    tables += [t for template in vlm_templates() for t in vlm_defaults(template.data, template.source).tables]
    for model_type, entries in tables:
        assert found.setdefault(model_type, dict(entries)) == dict(entries), f"{model_type} stated two ways"
    return found


STATED = stated_tables()


def class_value(config, key: str):
    """``key``'s value in a transformers config object; transformers 5 keeps the RoPE base (and partial rotary
    factor) in ``rope_parameters``: per layer type, the full-attention layers' (the sliding layers' for Gemma 3's
    ``rope_local_base_freq``)."""
    params = getattr(config, "rope_parameters", None) or {}
    per_type = "full_attention" in params
    if key == "rope_local_base_freq":
        return params["sliding_attention"]["rope_theta"]
    if key in ("rope_theta", "partial_rotary_factor"):
        return (params["full_attention"] if per_type else params).get(key, getattr(config, key, None))
    value = getattr(config, key)
    return list(value) if isinstance(value, tuple) else value


def other_value(value):
    """A different value of the same kind; strings and switches are kept (a class may validate a string, and a
    switch reshard requires off, such as Gemma 3's use_bidirectional_attention, halves the window)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value * 2
    if isinstance(value, list):
        return value[:-1]
    return value


def test_the_tables_cover_the_families_of_issue_42():
    wanted = {"llama", "mistral", "qwen2", "gemma", "gemma2", "gemma3_text", "qwen2_5_vl_text", "siglip_vision_model",
              "clip_vision_model", "llava", "llava_next"}
    assert wanted <= set(STATED), sorted(wanted - set(STATED))
    assert STATED["gemma3_text"]["rope_theta"] == 1e6 and STATED["gemma3_text"]["head_dim"] == 256


@pytest.mark.parametrize("model_type", sorted(STATED))
def test_every_stated_default_is_the_transformers_class_default(model_type):
    """Each stated key has the value ``CONFIG_MAPPING[model_type]()`` gives it, and keeps it when every other stated
    key is set otherwise (a constant, not a value transformers derives from other keys)."""
    cls = transformers.CONFIG_MAPPING[model_type]
    table = STATED[model_type]
    config = cls()
    assert {k: class_value(config, k) for k in table} == table
    for key, value in table.items():
        others = cls(**{k: other_value(v) for k, v in table.items() if k != key})
        assert class_value(others, key) == value, f"{model_type}.{key} follows the other keys"


def test_a_key_the_source_spells_wins_wherever_transformers_reads_it_from():
    """Gemma 3's RoPE bases spelt in transformers 5's per-layer-type rope_parameters are the source's, not the
    defaults; a key spelt null stays null; the keys left out read as transformers reads them."""
    family = load_shipped("gemma3")
    params = {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
              "sliding_attention": {"rope_type": "default", "rope_theta": 7.0}}
    config = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 6, "vocab_size": 300, "rope_parameters": params,
              "sliding_window": None}
    filled = with_defaults(family, config)
    assert "rope_theta" not in filled and "rope_local_base_freq" not in filled and filled["sliding_window"] is None
    theirs = transformers.Gemma3TextConfig(**{k: v for k, v in config.items() if k != "model_type"})
    assert (filled["head_dim"], filled["num_attention_heads"], filled["query_pre_attn_scalar"]) == \
        (theirs.head_dim, theirs.num_attention_heads, theirs.query_pre_attn_scalar)
    meaning = read_meaning(config, family, "Gemma3ForCausalLM", family.resolve_dims(config), set(), True, "test")
    assert (meaning.rope_theta, meaning.rope_local_theta, meaning.head_dim) == (5e5, 7.0, theirs.head_dim)


def test_a_spelt_alternative_key_is_not_overridden_by_a_default():
    """Qwen2-MoE's expert count may be spelt num_local_experts: num_experts' default is then not filled."""
    family = load_shipped("qwen2_moe")
    dims = family.resolve_dims({"model_type": "qwen2_moe", "num_local_experts": 4})
    assert dims[family.moe["experts"]] == 4


def test_a_default_for_a_key_the_family_does_not_read_is_refused():
    text = shipped_mapping_text("llama").replace("[config.architectures.LlamaForCausalLM.defaults]\n",
                                                 "[config.architectures.LlamaForCausalLM.defaults]\nrope_thetaa = 1.0\n")
    with pytest.raises(MappingError, match=r"rope_thetaa is not a config key .* \(did you mean 'rope_theta'\?\)"):
        parse_family(tomllib.loads(text), "llama-typo.toml")


# ---- sparse configs as the Hub releases spell them ---------------------------------------------------------------

#: google/gemma-3-4b-it's text_config keys (the 12b adds the head counts; the rest is Gemma3TextConfig's defaults:
#: RoPE bases 1e6 / 1e4, head_dim 256, vocab 262208, query_pre_attn_scalar 256, ...). The tiny copy also spells
#: head_dim and vocab_size, which tiny dims cannot take from the defaults; its head counts are the defaults (8, 4).
GEMMA3_HUB_TEXT = ("hidden_size", "intermediate_size", "model_type", "num_hidden_layers", "rope_scaling",
                   "sliding_window")
GEMMA3_HUB_VISION = ("hidden_size", "image_size", "intermediate_size", "model_type", "num_attention_heads",
                     "num_hidden_layers", "patch_size", "vision_use_head")
#: Qwen/Qwen2.5-VL-7B-Instruct's flat config.json (text keys at the top, M-RoPE in rope_scaling's old "mrope"
#: spelling, the tower's channels as in_chans); the tiny copy leaves rope_theta and rms_norm_eps, which that release
#: spells, to Qwen2_5_VLTextConfig (1e6 and 1e-5, not Qwen2Config's 1e4 and 1e-6).
QWEN25_HUB_TEXT = ("attention_dropout", "bos_token_id", "eos_token_id", "hidden_act", "hidden_size",
                   "initializer_range", "intermediate_size", "max_position_embeddings", "num_attention_heads",
                   "num_hidden_layers", "num_key_value_heads", "use_sliding_window", "vocab_size")
QWEN25_HUB_VISION = ("depth", "hidden_act", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size",
                     "patch_size", "spatial_merge_size", "window_size", "fullatt_block_indexes", "tokens_per_second",
                     "temporal_patch_size")
SPARSE = ("gemma3", "qwen2_5_vl")


def _tiny(family: str):
    """The tiny model, built from a config object with transformers' defaults where the Hub release has none
    (Gemma 3: 6 layers, so that layer 5 attends fully with the 1e6 base and linear scaling)."""
    if family == "gemma3":
        config = transformers.Gemma3Config(
            text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, head_dim=16, vocab_size=300,
                             sliding_window=16, rope_scaling={"rope_type": "linear", "factor": 8.0}),
            vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                               image_size=56, patch_size=14, vision_use_head=False),
            mm_tokens_per_image=4, image_token_index=260, boi_token_index=255, eoi_token_index=256,
            bos_token_id=2, eos_token_id=1, pad_token_id=0)
    else:
        config = transformers.Qwen2_5_VLConfig(
            text_config=dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             bos_token_id=1, eos_token_id=2,
                             rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]}),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                               fullatt_block_indexes=[1]),
            image_token_id=151, video_token_id=152, vision_start_token_id=153, vision_end_token_id=154)
    config.architectures = [vlm_cases.ARCHITECTURES[family]]
    torch.manual_seed(0)
    model = getattr(transformers, vlm_cases.ARCHITECTURES[family])(config).float().eval()
    return vlm_cases.perturb(model, vlm_cases._seed(family, 1))


def hub_spelled(family: str, saved: dict) -> dict:
    """config.json as the Hub release spells it, from the one transformers saved (``saved``)."""
    text, vision = saved["text_config"], saved["vision_config"]
    if family == "gemma3":
        return {"architectures": saved["architectures"], "boi_token_index": 255, "eoi_token_index": 256,
                "eos_token_id": 1, "image_token_index": 260, "initializer_range": 0.02, "mm_tokens_per_image": 4,
                "model_type": "gemma3", "torch_dtype": "float32", "transformers_version": "4.50.0.dev0",
                "text_config": {**{k: text[k] for k in GEMMA3_HUB_TEXT if k in text}, "head_dim": 16,
                                "vocab_size": 300, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
                "vision_config": {k: vision[k] for k in GEMMA3_HUB_VISION}}
    return {**{k: text[k] for k in QWEN25_HUB_TEXT},
            **{k: saved[k] for k in ("architectures", "image_token_id", "video_token_id", "vision_start_token_id",
                                     "vision_end_token_id", "model_type", "tie_word_embeddings")},
            "max_window_layers": 2, "sliding_window": 32768, "torch_dtype": "float32", "use_cache": True,
            "transformers_version": "4.41.2", "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "vision_config": {**{k: vision[k] for k in QWEN25_HUB_VISION}, "in_chans": 3, "spatial_patch_size": 14}}


def save_sparse(family: str, folder: Path) -> Path:
    """The tiny ``family`` model in the Hub's tensor spelling with its config.json rewritten as the Hub spells it;
    transformers reads it as the model it built (same logits as the full config.json)."""
    model = _tiny(family)
    model.save_pretrained(folder)
    tensors, _ = vlm_cases.read_tensors(folder)
    vlm_cases._write_tensors(folder, {vlm_cases._sub(vlm_cases._FRESH_TO_HUB, k) if family == "gemma3" else k: v
                                      for k, v in tensors.items()})
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(hub_spelled(family, saved), indent=2))
    assert torch.equal(vlm_cases.logits(folder, family), vlm_cases.model_logits(model, family))
    return folder


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    """family -> its tiny Hub-spelled sparse folder (built once per module)."""
    root = tmp_path_factory.mktemp("sparse")
    return {family: save_sparse(family, root / family) for family in SPARSE}


#: The text config attributes transformers computes with (compared as transformers reads each folder).
TEXT_MEANING = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "rms_norm_eps", "rope_parameters", "max_position_embeddings",
                "sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping", "hidden_activation", "hidden_act", "use_sliding_window")


def text_meaning(folder: Path) -> dict:
    text = transformers.AutoConfig.from_pretrained(str(folder)).text_config
    return {k: getattr(text, k, None) for k in TEXT_MEANING}


def full_theta(folder: Path) -> float:
    """The RoPE base of full-attention layers as transformers reads ``folder``'s config.json."""
    params = transformers.AutoConfig.from_pretrained(str(folder)).text_config.rope_parameters
    return (params.get("full_attention") or params)["rope_theta"]


def convert(capsys, src, dst, *args) -> Path:
    code, _, err = run_cli(capsys, "convert", src, dst, *map(str, args))
    assert code == 0, err.strip()[-1500:]
    return dst


@pytest.mark.parametrize("family", SPARSE)
def test_a_sparse_hub_config_converts_with_transformers_meaning(sparse, tmp_path, capsys, family):
    """hf -> megatron tp2 pp2 -> hf and hf -> vllm tp2 (-> hf): each config.json means to transformers what the
    source's does, Megatron's rotary_base is the source's base (1e6), and transformers' logits with an image
    equal the source's."""
    src = sparse[family]
    want = text_meaning(src)
    megatron = convert(capsys, src, tmp_path / "megatron", "--to", "megatron", "--tp", 2, "--pp", 2)
    args = torch.load(megatron / "release" / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=False)["args"]
    assert args.rotary_base == full_theta(src) == 1e6
    back = convert(capsys, megatron, tmp_path / "back", "--to", "hf")
    vllm = convert(capsys, src, tmp_path / "vllm", "--to", "vllm", "--tp", 2)
    again = convert(capsys, vllm, tmp_path / "again", "--to", "hf")
    expected = vlm_cases.logits(src, family)
    for out in (back, vllm, again):
        assert text_meaning(out) == want, out.name
    for out in (back, again):
        assert torch.equal(vlm_cases.logits(out, family), expected), out.name


@pytest.mark.parametrize("family", SPARSE)
def test_verify_tells_a_copy_that_writes_another_rope_base_apart(sparse, tmp_path, capsys, family):
    """A copy whose config.json writes rope_theta 10000 (what reshard used to read and write) computes other logits
    in transformers, and ``reshard verify`` says DIFFERENT, naming rope_theta; the source against itself is EQUAL."""
    src = sparse[family]
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    config = json.loads((copy / "config.json").read_text())
    (config.get("text_config") or config)["rope_theta"] = 10000.0
    (copy / "config.json").write_text(json.dumps(config))
    assert full_theta(copy) == 10000.0
    assert not torch.equal(vlm_cases.logits(copy, family), vlm_cases.logits(src, family))
    code, out, _ = run_cli(capsys, "verify", src, copy)
    assert code == 1 and "DIFFERENT" in out and "rope_theta" in out, out
    code, out, _ = run_cli(capsys, "verify", src, src)
    assert code == 0 and "EQUAL" in out, out


# ---- real-size sparse copies of two releases ---------------------------------------------------------------------

#: config.json of google/gemma-3-12b-it and llava-hf/llava-1.5-7b-hf as the Hub serves them (sparse text_config).
RELEASES = {
    "gemma-3-12b-it": {
        "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
        "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
        "model_type": "gemma3", "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
        "text_config": {"hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text",
                        "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                          "patch_size": 14, "vision_use_head": False}},
    "llava-1.5-7b-hf": {
        "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
        "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu", "tie_word_embeddings": False,
        "torch_dtype": "float16", "transformers_version": "4.36.0.dev0", "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default", "vocab_size": 32064,
        "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                        "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                        "torch_dtype": "float16", "vocab_size": 32064},
        "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                          "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                          "patch_size": 14, "projection_dim": 768, "vocab_size": 32000}},
}
#: Two more releases whose text_config transformers fills (gemma-3-4b-it: no head counts; LLaVA-NeXT's Mistral: no
#: hidden size, head or layer counts), read at the config level only.
CONFIG_ONLY = {
    "gemma-3-4b-it": {**RELEASES["gemma-3-12b-it"],
                      "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                      "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                      "sliding_window": 1024}},
    "llava-v1.6-mistral-7b-hf": {
        "architectures": ["LlavaNextForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
        "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
        "model_type": "llava_next", "projector_hidden_act": "gelu", "torch_dtype": "float16",
        "transformers_version": "4.39.0.dev0", "use_image_newline_parameter": True, "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default", "vocab_size": 32064,
        "text_config": {"_name_or_path": "mistralai/Mistral-7B-Instruct-v0.2", "architectures": ["MistralForCausalLM"],
                        "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
                        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
                        "sliding_window": None, "torch_dtype": "bfloat16", "vocab_size": 32064},
        "vision_config": RELEASES["llava-1.5-7b-hf"]["vision_config"]},
}
#: transformers 5's in-memory names -> the Hub's (the inverse of vlm_cases' Hub -> v5 rules for these towers).
TO_HUB = [(r"^model\.language_model\.", "language_model.model."), (r"^lm_head\.", "language_model.lm_head."),
          (r"^model\.vision_tower\.(vision_model\.)?", "vision_tower.vision_model."),
          (r"^model\.multi_modal_projector\.", "multi_modal_projector.")]


def write_release(folder: Path, name: str) -> tuple[object, int]:
    """A sparse copy of release ``name``: its config.json, and every tensor transformers builds for it (on the meta
    device: names and shapes, no data) in the Hub spelling, over 4 sparse safetensors files with an index (a tied
    head is not stored). Returns (transformers' config, the weight bytes)."""
    config_json = RELEASES[name]
    config = transformers.AutoConfig.for_model(**config_json)
    with torch.device("meta"):
        model = getattr(transformers, config_json["architectures"][0])(config)
    tied = config.tie_word_embeddings
    shapes = {vlm_cases._sub(TO_HUB, k): tuple(v.shape) for k, v in model.state_dict().items()
              if not (tied and k == "lm_head.weight")}
    folder.mkdir()
    names, weight_map, total = list(shapes), {}, 0
    for i in range(4):
        part = {n: shapes[n] for n in names[i::4]}
        file = f"model-{i + 1:05d}-of-00004.safetensors"
        total += _sparse_safetensors(str(folder / file), part)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config_json))
    return config, total


def transformers_meaning(text) -> dict:
    """What transformers' text config object ``text`` computes with, in ModelConfig's field names."""
    params = text.rope_parameters
    return {"hidden": text.hidden_size, "layers": text.num_hidden_layers, "heads": text.num_attention_heads,
            "kv_heads": text.num_key_value_heads, "head_dim": text.head_dim, "ffn": text.intermediate_size,
            "vocab": text.vocab_size, "max_positions": text.max_position_embeddings, "norm_eps": text.rms_norm_eps,
            "rope_theta": (params.get("full_attention") or params)["rope_theta"],
            "rope_local_theta": (params.get("sliding_attention") or {}).get("rope_theta"),
            "query_scale": getattr(text, "query_pre_attn_scalar", None),
            "sliding_window": getattr(text, "sliding_window", None)}


@pytest.mark.parametrize("name", sorted(RELEASES) + sorted(CONFIG_ONLY))
def test_a_release_config_means_what_transformers_reads(name):
    """Each release's config.json, composed and read by reshard (no weights), has transformers' dims and RoPE."""
    config_json = {**RELEASES, **CONFIG_ONLY}[name]
    architecture = config_json["architectures"][0]
    family = family_for_architecture(architecture, None, config_json)
    flat = flat_view(config_json)
    meaning = read_meaning(flat, family, architecture, family.resolve_dims(flat), set(), True, name).as_dict()
    expected = transformers_meaning(transformers.AutoConfig.for_model(**config_json).text_config)
    assert {k: meaning[k] for k in expected} == expected


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_real_size_sparse_releases_inspect_and_plan_with_transformers_dims(tmp_path, capsys, name):
    """``inspect`` reports the dims, RoPE bases and head dim transformers reads from the release's sparse
    config.json (gemma-3-12b: head_dim 256, not hidden / heads = 240; llava-1.5-7b: hidden 4096, 32 heads, vocab
    32064); ``plan`` to HF plans every byte of the weights, and ``plan`` to vLLM tp 2 plans both ranks."""
    config, total = write_release(tmp_path / name, name)
    text = config.text_config
    code, out, err = run_cli(capsys, "inspect", tmp_path / name, "--json")
    assert code == 0, err
    meaning = json.loads(out)["model_config"]
    expected = transformers_meaning(text)
    assert {k: meaning.get(k) for k in expected} == expected
    if name == "gemma-3-12b-it":
        assert meaning["head_dim"] == 256 != meaning["hidden"] // meaning["heads"]
    else:
        assert (meaning["hidden"], meaning["heads"], meaning["vocab"]) == (4096, 32, 32064)
        blocks = config.vision_config.num_hidden_layers  # hidden state l is block l's output
        assert json.loads(out)["vision"]["used_blocks"] == blocks + 1 + config.vision_feature_layer
    code, out, err = run_cli(capsys, "plan", tmp_path / name, "--to", "hf", "--json")
    assert code == 0, err
    assert sum(f["bytes"] for f in json.loads(out)["files"]) == total
    code, out, err = run_cli(capsys, "plan", tmp_path / name, "--to", "vllm", "--tp", "2")
    assert code == 0 and out.startswith("plan: hf -> vllm") and "model-rank-1-part-0.safetensors" in out, err
