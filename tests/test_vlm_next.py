"""LLaVA-NeXT (LlavaNextForConditionalGeneration, mappings/llava_next.toml) in hf and vllm: LLaVA's CLIP tower and
projector plus ``image_newline [text hidden]``, whole everywhere. The tiny model (tests/vlm_cases.py, family
``vlm_cases.NEXT``: a Mistral text model, CLIP with an unused last layer) is converted by reshard and checked
against transformers (logits on a prompt with an anyres image, the spellings it reads and writes) and against the
independent vLLM rule module (tests/vlm_rules.py, itself checked against vLLM 0.32 by the opt-in
tests/test_vlm_rules.py). Megatron is refused: no megatron-core module holds image_newline. test_vlm.py runs the
other four families (its round trip goes through Megatron)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import vlm_cases
import vlm_rules
from helpers import run_cli
from test_vlm import assert_same_config, assert_same_tensors, convert, llava_unused, logits_without

FAMILY = vlm_cases.NEXT
#: config.json keys only LLaVA-NeXT has or uses, kept at the top level as transformers and vLLM read them
NEXT_KEYS = ("image_grid_pinpoints", "vision_feature_layer", "vision_feature_select_strategy")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return vlm_cases.save_hub(FAMILY, tmp_path_factory.mktemp("vlm_next") / "hub")


@pytest.fixture(scope="module")
def source_logits(hub):
    return vlm_cases.logits(hub, FAMILY)


def test_the_image_prompt_uses_image_newline(hub, source_logits):
    """The fixture's image (1 x 2 tiles) fills as many image tokens as transformers packs, and its logits depend on
    image_newline, so the round trip below checks that tensor too."""
    model = vlm_cases.load(hub, FAMILY)
    inputs = vlm_cases.image_inputs(FAMILY, model.config)
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                  image_sizes=inputs["image_sizes"]).pooler_output
        assert [f.shape[0] for f in features] == [vlm_cases.llava_next_image_tokens(model.config)]
        model.model.image_newline.zero_()
    assert not torch.allclose(vlm_cases.model_logits(model, FAMILY, inputs), source_logits)


def test_hf_to_vllm_tp2_and_back_is_bit_exact_and_keeps_the_image_logits(hub, source_logits, tmp_path, capsys):
    """hf -> vllm tp2 -> hf: the source's bytes but the CLIP layer past vision_feature_layer and post_layernorm
    (vLLM builds neither: refused without --allow-missing vision), the source's config.json (pinpoints, feature
    layer and strategy at the top level, in the vLLM folder too), and transformers' logits with an image."""
    config = vlm_cases.config_of(hub)
    vllm = convert(capsys, hub, tmp_path / "vllm", "--to", "vllm", "--tp", 2)
    vllm_config = vlm_cases.config_of(vllm)
    assert all(vllm_config[k] == config[k] for k in NEXT_KEYS) and "image_grid_pinpoints" in config
    missing = llava_unused(config)
    assert len(missing) == 18
    code, _, err = run_cli(capsys, "convert", vllm, tmp_path / "refused", "--to", "hf")
    assert code == 2 and "--allow-missing vision" in err and "post_layernorm" in err
    assert not (tmp_path / "refused").exists()
    back = convert(capsys, vllm, tmp_path / "hf", "--to", "hf", "--allow-missing", "vision")
    assert_same_tensors(hub, back, missing)
    assert "image_newline" in load_file(back / "model.safetensors")
    assert_same_config(hub, back)
    assert (logits_without(back, FAMILY, missing) - source_logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("spelling", [s for s in vlm_cases.FAMILY_SPELLINGS[FAMILY] if s != "hub"])
def test_every_spelling_reads_to_the_hub_bytes(hub, tmp_path, capsys, spelling):
    """transformers 5's own (``model.image_newline``), the doubled .model.model, v5 with vision_model. and a fresh
    5.x save read to the Hub tensors, written in the Hub spelling."""
    respelt = vlm_cases.respell(hub, tmp_path / spelling, FAMILY, spelling)
    assert_same_tensors(hub, convert(capsys, respelt, tmp_path / "hf", "--to", "hf"))


def test_hf_spelling_v5_writes_transformers_5_names(hub, source_logits, tmp_path, capsys):
    vlm_cases.load(hub, FAMILY).save_pretrained(tmp_path / "tf_v5", save_original_format=False)
    out = convert(capsys, hub, tmp_path / "v5", "--to", "hf", "--hf-spelling", "v5")
    names = set(load_file(out / "model.safetensors"))
    assert names == set(load_file(tmp_path / "tf_v5" / "model.safetensors")) and "model.image_newline" in names
    assert torch.equal(vlm_cases.logits(out, FAMILY), source_logits)


def test_vllm_rank_tensors_equal_the_rule_module(hub, tmp_path, capsys):
    """Every vLLM tp2 rank tensor (names, dtypes, bytes) equals the rules': image_newline whole on both ranks."""
    hf, config = load_file(hub / "model.safetensors"), vlm_cases.config_of(hub)
    out = convert(capsys, hub, tmp_path / "vllm", "--to", "vllm", "--tp", 2)
    vlm_rules.assert_vllm_folder_follows_rules(out, hf, config, FAMILY, 2)
    for rank in range(2):
        assert torch.equal(load_file(out / f"model-rank-{rank}-part-0.safetensors")["image_newline"],
                           hf["image_newline"])


@pytest.mark.parametrize("args", [["--to", "megatron"], ["--to", "megatron", "--megatron-vision", "native"],
                                  ["--to", "megatron", "--megatron-vision", "hf", "--tp", "2"],
                                  ["--to", "torch_dist"]])
def test_megatron_is_refused_naming_image_newline(hub, tmp_path, capsys, args):
    code, _, err = run_cli(capsys, "convert", hub, tmp_path / "out", *args)
    assert code == 2 and "image_newline" in err and "llava_next" in err, err
    assert not (tmp_path / "out").exists()


def test_vllm_vision_none_keeps_the_bare_image_newline(hub, tmp_path, capsys):
    """An engine with limit_mm_per_prompt {"image": 0} builds no tower and no projector, but image_newline (not a
    module) stays in its state on the meta device, so its sharded_state folder must hold it (vlm_rules)."""
    hf, config = load_file(hub / "model.safetensors"), vlm_cases.config_of(hub)
    out = convert(capsys, hub, tmp_path / "vllm", "--to", "vllm", "--tp", 2, "--vllm-vision", "none")
    for rank in range(2):
        got = load_file(out / f"model-rank-{rank}-part-0.safetensors")
        want = vlm_rules.vllm_rank_tensors(hf, config, FAMILY, 2, rank, vision="none")
        assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
