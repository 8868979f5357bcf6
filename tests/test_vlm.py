"""Vision-language models (Qwen2.5-VL, Qwen3-VL, Gemma 3, LLaVA) in hf, megatron and vllm: tiny transformers models
(tests/vlm_cases.py) converted by reshard, checked against transformers itself (logits with an image, the
spellings its loader reads and save_pretrained writes) and against an independent rule module of vLLM 0.32's
per-rank tensors written from the spec (tests/vlm_rules.py, itself checked against vLLM by the opt-in
tests/test_vlm_rules.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import vlm_cases
import vlm_rules
from helpers import run_cli

#: the family's Megatron vision layouts: the default first, then the other one where a framework builds it
MEGATRON_VISIONS = {"qwen2_5_vl": ("hf", "native"), "qwen3_vl": ("native", "hf"), "gemma3": ("hf",),
                    "llava": ("native",)}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """family -> its tiny model saved in the Hub spelling (built once per module)."""
    root = tmp_path_factory.mktemp("vlm")
    made = {}

    def get(family):
        if family not in made:
            made[family] = vlm_cases.save_hub(family, root / family)
        return made[family]

    return get


def convert(capsys, src, dst, *args):
    code, out, err = run_cli(capsys, "convert", src, dst, *map(str, args))
    assert code == 0, f"reshard convert {src} {dst} {' '.join(map(str, args))}: {err.strip()[-1500:]}"
    return dst


def llava_unused(config) -> set[str]:
    """LLaVA's tensors vLLM and megatron-core do not build: the CLIP layers past vision_feature_layer and
    post_layernorm (written here from transformers' own definition: hidden state l is block l's output)."""
    vision = config["vision_config"]
    layers, feature = vision["num_hidden_layers"], config["vision_feature_layer"]
    used = layers + 1 + feature if feature < 0 else feature
    names = {f"vision_tower.vision_model.post_layernorm.{p}" for p in ("weight", "bias")}
    for b in range(used, layers):
        prefix = f"vision_tower.vision_model.encoder.layers.{b}."
        names |= {prefix + n for n in ("layer_norm1.weight", "layer_norm1.bias", "layer_norm2.weight",
                                        "layer_norm2.bias", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight",
                                        "mlp.fc2.bias")}
        names |= {prefix + f"self_attn.{m}_proj.{p}" for m in "qkvo" if m != "o" for p in ("weight", "bias")}
        names |= {prefix + f"self_attn.out_proj.{p}" for p in ("weight", "bias")}
    return names


def assert_same_tensors(src, dst, missing=frozenset()):
    a, b = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    assert set(a) - set(b) == set(missing) and set(b) <= set(a), (sorted(set(a) ^ set(b))[:5])
    for name, tensor in b.items():
        assert tensor.dtype == a[name].dtype and torch.equal(tensor, a[name]), name


def assert_same_config(src, dst):
    a, b = (json.loads((f / "config.json").read_text()) for f in (src, dst))
    for config in (a, b):
        config.pop("dtype", None), config.pop("torch_dtype", None), config.pop("transformers_version", None)
    assert a == b


@pytest.mark.parametrize("family", vlm_cases.FAMILIES)
def test_round_trip_through_megatron_and_vllm_is_bit_exact_and_keeps_the_image_logits(hub, tmp_path, capsys, family):
    """hf -> megatron tp2 pp2 (the family's default vision layout) -> vllm tp2 -> hf: the source's bytes and
    config, and transformers' logits on a prompt with an image equal the source's."""
    src = hub(family)
    config = json.loads((src / "config.json").read_text())
    megatron = convert(capsys, src, tmp_path / "megatron", "--to", "megatron", "--tp", 2, "--pp", 2)
    vllm = convert(capsys, megatron, tmp_path / "vllm", "--to", "vllm", "--tp", 2)
    missing = llava_unused(config) if family == "llava" else set()
    extra = ["--allow-missing", "vision"] if missing else []
    if missing:  # refused without the flag, naming what is missing
        code, _, err = run_cli(capsys, "convert", vllm, tmp_path / "refused", "--to", "hf")
        assert code == 2 and "--allow-missing vision" in err and "post_layernorm" in err
        assert not (tmp_path / "refused").exists()
    back = convert(capsys, vllm, tmp_path / "hf", "--to", "hf", *extra)
    assert_same_tensors(src, back, missing)
    assert_same_config(src, back)
    expected, got = vlm_cases.logits(src, family), logits_without(back, family, missing)
    assert (got - expected).abs().max().item() <= 1e-5


def logits_without(folder, family, missing):
    """transformers' logits with an image of ``folder``, which lacks exactly ``missing`` (newly initialised)."""
    import transformers

    if not missing:
        return vlm_cases.logits(folder, family)
    model, info = getattr(transformers, vlm_cases.ARCHITECTURES[family]).from_pretrained(
        str(folder), dtype=torch.float32, output_loading_info=True)
    assert len(info["missing_keys"]) == len(missing) and not info["unexpected_keys"]
    return vlm_cases.model_logits(model.eval(), family)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_other_megatron_vision_layout_round_trips(hub, tmp_path, capsys, family):
    """Qwen2.5-VL's native layout and Qwen3-VL's HF-module layout (the non-default ones) read back bit-exact, and
    the layout is recognised from the names on read."""
    src = hub(family)
    other = MEGATRON_VISIONS[family][1]
    megatron = convert(capsys, src, tmp_path / "megatron", "--to", "megatron", "--tp", 2, "--pp", 2,
                       "--megatron-vision", other)
    names = set(torch.load(megatron / "release" / "mp_rank_00_000" / "model_optim_rng.pt",
                           weights_only=False)["model"])
    assert any(n.startswith("vision_model.decoder.layers.") for n in names) == (other == "native")
    assert_same_tensors(src, convert(capsys, megatron, tmp_path / "hf", "--to", "hf"))


@pytest.mark.parametrize("family", vlm_cases.FAMILIES)
def test_torch_dist_round_trip(hub, tmp_path, capsys, family):
    """hf -> torch_dist (saved at tp2 pp2, each family's Megatron vision layouts) -> hf: the source's tensors (LLaVA
    less post_layernorm, which megatron-core does not build; it builds every CLIP layer, as Megatron-LM's LLaVA
    examples do) and config."""
    src = hub(family)
    missing = {f"vision_tower.vision_model.post_layernorm.{p}" for p in ("weight", "bias")} if family == "llava" \
        else set()
    for vision in MEGATRON_VISIONS[family]:
        dist = convert(capsys, src, tmp_path / vision, "--to", "torch_dist", "--tp", 2, "--pp", 2,
                       "--megatron-vision", vision)
        back = convert(capsys, dist, tmp_path / f"{vision}_hf", "--to", "hf",
                       *(["--allow-missing", "vision"] if missing else []))
        assert_same_tensors(src, back, missing)
        assert_same_config(src, back)


def flat_qwen25(src, folder):
    """``src`` with the flat config.json Qwen2.5-VL Hub checkpoints have (the language model's keys at the top,
    ``rope_scaling = {"type": "mrope", "mrope_section": ...}``, ``torch_dtype``), as transformers 4.x wrote it."""
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    config = json.loads((src / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    for key in ("model_type", "layer_types", "bos_token_id", "eos_token_id", "pad_token_id"):
        text.pop(key, None)
    config.update(text, rope_theta=rope["rope_theta"], torch_dtype=config.pop("dtype"),
                  rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_flat_qwen25_config_round_trips(hub, tmp_path, capsys):
    """The flat config of Qwen2.5-VL Hub checkpoints reads (M-RoPE from rope_scaling's old "mrope" spelling) and
    comes back as it was through megatron tp2 and vllm tp2; transformers' image logits equal the source's."""
    src = flat_qwen25(hub("qwen2_5_vl"), tmp_path / "flat")
    megatron = convert(capsys, src, tmp_path / "megatron", "--to", "megatron", "--tp", 2)
    back = convert(capsys, convert(capsys, megatron, tmp_path / "vllm", "--to", "vllm", "--tp", 2),
                   tmp_path / "hf", "--to", "hf")
    assert_same_tensors(src, back)
    assert json.loads((back / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert torch.equal(vlm_cases.logits(back, "qwen2_5_vl"), vlm_cases.logits(hub("qwen2_5_vl"), "qwen2_5_vl"))


def test_qwen3_vl_deepstack_layers_stay_on_the_first_stage(hub, tmp_path, capsys):
    """Qwen3-VL adds its DeepStack features to the first K language-model layers: a pp that moves one of them off
    the first stage is refused (K = 2 of 4 layers: pp 2 works, pp 4 does not)."""
    code, _, err = run_cli(capsys, "convert", hub("qwen3_vl"), tmp_path / "pp4", "--to", "megatron", "--pp", 4)
    assert code == 2 and "DeepStack" in err and not (tmp_path / "pp4").exists()


def test_megatron_tower_placement_and_splits(hub, tmp_path, capsys):
    """Qwen2.5-VL at tp2 pp2: the tower is on the first stage only; HF modules whole on both TP ranks (qkv =
    HF's fused [Q; K; V]); native: qkv per head [q_h; k_h; v_h] of the rank's heads, proj split on columns."""
    src = hub("qwen2_5_vl")
    hf = load_file(src / "model.safetensors")
    nv = json.loads((src / "config.json").read_text())["vision_config"]["num_heads"]
    for vision in ("hf", "native"):
        out = convert(capsys, src, tmp_path / vision, "--to", "megatron", "--tp", 2, "--pp", 2,
                      "--megatron-vision", vision)
        ranks = {(t, p): torch.load(out / "release" / f"mp_rank_0{t}_00{p}" / "model_optim_rng.pt",
                                    weights_only=False)["model"] for t in range(2) for p in range(2)}
        for t in range(2):
            assert not any(n.startswith(("visual.", "vision_model.")) for n in ranks[(t, 1)])
            rank = ranks[(t, 0)]
            qkv = hf["visual.blocks.1.attn.qkv.weight"]
            if vision == "hf":
                assert torch.equal(rank["visual.blocks.1.attn.qkv.weight"], qkv)
                assert torch.equal(rank["visual.merger.mlp.2.weight"], hf["visual.merger.mlp.2.weight"])
                continue
            q, k, v = qkv.chunk(3)
            d = q.shape[0] // nv
            heads = range(t * nv // 2, (t + 1) * nv // 2)
            want = torch.cat([x[h * d:(h + 1) * d] for h in heads for x in (q, k, v)])
            assert torch.equal(rank["vision_model.decoder.layers.1.self_attention.linear_qkv.weight"], want)
            proj = hf["visual.blocks.1.attn.proj.weight"]
            assert torch.equal(rank["vision_model.decoder.layers.1.self_attention.linear_proj.weight"],
                               proj.chunk(2, dim=1)[t])
            assert "vision_model.decoder.layers.1.self_attention.linear_qkv._extra_state" in rank


@pytest.mark.parametrize("family,spelling", [(f, s) for f in vlm_cases.FAMILIES
                                             for s in vlm_cases.FAMILY_SPELLINGS[f] if s != "hub"])
def test_every_spelling_reads_to_the_hub_bytes(hub, tmp_path, capsys, family, spelling):
    """Each transformers spelling (v5, the doubled .model.model, v5 with vision_model., a fresh 5.x save) reads to
    the same tensors, and the HF output is written in the Hub spelling."""
    src = hub(family)
    respelt = vlm_cases.respell(src, tmp_path / spelling, family, spelling)
    assert_same_tensors(src, convert(capsys, respelt, tmp_path / "hf", "--to", "hf"))


@pytest.mark.parametrize("family", vlm_cases.FAMILIES)
def test_hf_spelling_v5_writes_transformers_5_names(hub, tmp_path, capsys, family):
    """--hf-spelling v5 writes the names transformers 5.24 saves with save_original_format=False (Qwen3-VL's are
    its Hub names), and transformers loads them to the same logits."""
    src = hub(family)
    model = vlm_cases.load(src, family)
    model.save_pretrained(tmp_path / "tf_v5", save_original_format=False)
    out = convert(capsys, src, tmp_path / "v5", "--to", "hf", "--hf-spelling", "v5")
    assert set(load_file(out / "model.safetensors")) == set(load_file(tmp_path / "tf_v5" / "model.safetensors"))
    assert torch.equal(vlm_cases.logits(out, family), vlm_cases.logits(src, family))


@pytest.mark.parametrize("family", vlm_cases.FAMILIES)
def test_vllm_rank_tensors_equal_the_rule_module(hub, tmp_path, capsys, family):
    """Every vLLM tp2 rank tensor (names, dtypes, bytes) equals the independently written rules'."""
    src = hub(family)
    hf, config = load_file(src / "model.safetensors"), json.loads((src / "config.json").read_text())
    out = convert(capsys, src, tmp_path / "vllm", "--to", "vllm", "--tp", 2)
    vlm_rules.assert_vllm_folder_follows_rules(out, hf, config, family, 2)


def test_vllm_vision_none_writes_the_language_model_only(hub, tmp_path, capsys):
    """--vllm-vision none: the ranks of an engine with limit_mm_per_prompt all 0 (rules' vision="none"); read back,
    the tower is missing and HF output needs --allow-missing vision."""
    src = hub("qwen2_5_vl")
    hf, config = load_file(src / "model.safetensors"), json.loads((src / "config.json").read_text())
    out = convert(capsys, src, tmp_path / "vllm", "--to", "vllm", "--tp", 2, "--vllm-vision", "none")
    vlm_rules.assert_vllm_folder_follows_rules(out, hf, config, "qwen2_5_vl", 2, vision="none")
    code, _, err = run_cli(capsys, "convert", out, tmp_path / "hf", "--to", "hf")
    assert code == 2 and "--allow-missing vision" in err


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_vllm_vision_data_keeps_the_tower_whole_on_every_rank(hub, tmp_path, capsys, family):
    """--vllm-vision data: the ranks of an engine with mm_encoder_tp_mode="data" (rules' vision="data", checked
    against vLLM by the opt-in rule tests); read back bit-exact; LLaVA, whose vLLM model lacks the mode, refused."""
    src = hub(family)
    hf, config = load_file(src / "model.safetensors"), json.loads((src / "config.json").read_text())
    out = convert(capsys, src, tmp_path / "vllm", "--to", "vllm", "--tp", 2, "--vllm-vision", "data")
    vlm_rules.assert_vllm_folder_follows_rules(out, hf, config, family, 2, vision="data")
    assert 'mm_encoder_tp_mode="data"' in json.loads((out / "reshard.json").read_text())["load_with"]
    assert_same_tensors(src, convert(capsys, out, tmp_path / "hf", "--to", "hf"))
    code, _, err = run_cli(capsys, "convert", hub("llava"), tmp_path / "llava", "--to", "vllm", "--tp", 2,
                           "--vllm-vision", "data")
    assert code == 2 and "mm_encoder_tp_mode" in err


def test_vllm_llava_to_megatron_writes_what_it_holds(hub, tmp_path, capsys):
    """A vLLM LLaVA lacks the CLIP layer megatron-core builds: --to megatron is refused without --allow-missing
    vision; with it, the Megatron folder (only the used layers) reads back, the unused layer absent, to the same
    vLLM ranks."""
    vllm = convert(capsys, hub("llava"), tmp_path / "vllm", "--to", "vllm", "--tp", 2)
    code, _, err = run_cli(capsys, "convert", vllm, tmp_path / "refused", "--to", "megatron", "--tp", 2)
    assert code == 2 and "--allow-missing vision" in err and not (tmp_path / "refused").exists()
    megatron = convert(capsys, vllm, tmp_path / "megatron", "--to", "megatron", "--tp", 2, "--allow-missing", "vision")
    again = convert(capsys, megatron, tmp_path / "again", "--to", "vllm", "--tp", 2)
    for rank in range(2):
        a, b = (load_file(f / f"model-rank-{rank}-part-0.safetensors") for f in (vllm, again))
        assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_verify_reports_the_tower_tensors_a_vllm_llava_lacks(hub, tmp_path, capsys):
    src = hub("llava")
    out = convert(capsys, src, tmp_path / "vllm", "--to", "vllm", "--tp", 2)
    code, stdout, _ = run_cli(capsys, "verify", src, out, "--json")
    report = json.loads(stdout)
    missing = {t["name"] for t in report["tensors"] if t["status"] == "missing_in_b"}
    assert code != 0 and missing == llava_unused(json.loads((src / "config.json").read_text()))
    assert all(t["status"] == "equal" for t in report["tensors"] if t["name"] not in missing)
    code, stdout, _ = run_cli(capsys, "inspect", hub("qwen2_5_vl"))
    assert code == 0 and "mrope_section=[2, 3, 3]" in stdout  # sections, not a range of layers
    code, stdout, _ = run_cli(capsys, "inspect", out, "--json")
    vision = json.loads(stdout)["vision"]
    assert code == 0 and (vision["blocks"], vision["used_blocks"], vision["absent"]) == (3, 2, len(missing))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_verify_forward_runs_the_text_decoder_at_tp2(hub, tmp_path, capsys, family):
    src = hub(family)
    out = convert(capsys, src, tmp_path / "megatron", "--to", "megatron", "--tp", 2)
    code, stdout, err = run_cli(capsys, "verify", src, out, "--forward", "--nproc", 2)
    assert code == 0 and "FORWARD EQUAL" in stdout, err[-1000:]
    assert "note: the vision tower (" in stdout and "tensors) was not run: the forward check runs the language " \
        "model" in stdout, stdout  # what the verdict does not cover


def test_load_rank_and_live_plans_know_the_towers(hub, tmp_path, capsys):
    """``reshard.load_rank`` gives a vLLM rank's file bit for bit, and a live plan from a Megatron tp2 job (the
    default vision layout) to vLLM tp2 ranks fills every tensor of each rank file, shapes included."""
    import reshard
    from reshard import live

    src = hub("gemma3")
    out = convert(capsys, src, tmp_path / "vllm", "--to", "vllm", "--tp", 2)
    files = [load_file(out / f"model-rank-{r}-part-0.safetensors") for r in range(2)]
    got = reshard.load_rank(str(src), "vllm", tp=2, rank=1)
    assert set(got) == set(files[1]) and all(torch.equal(got[n], files[1][n]) for n in files[1])
    config = json.loads((src / "config.json").read_text())
    plan = live.plan(config, {"layout": "megatron", "tp": 2}, {"layout": "vllm", "tp": 2}, source_ranks=[0, 1],
                     target_ranks=[2, 3])
    for rank, file in enumerate(files):
        assert {t.name: tuple(t.shape) for t in plan.targets[rank]} == {n: tuple(v.shape) for n, v in file.items()}


def test_mllama_is_refused_naming_the_supported_families(tmp_path, capsys):
    src = vlm_cases.save_mllama(tmp_path / "mllama")
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "hf")
    assert code == 2 and "MllamaForConditionalGeneration is a vision-language model" in err
    assert all(arch in err for arch in vlm_cases.ARCHITECTURES.values())
    assert not (tmp_path / "out").exists()


def test_vision_heads_that_do_not_divide_tp_are_refused(tmp_path, capsys):
    """3 vision heads at tp 2: vLLM and native Megatron refuse naming the config key; the HF-module layout,
    whole on every rank, converts."""
    src = vlm_cases.save_indivisible_qwen25(tmp_path / "src")
    for args in (["--to", "vllm"], ["--to", "megatron", "--megatron-vision", "native"]):
        code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--tp", 2, *args)
        assert code == 2 and "vision_config.num_heads" in err and "tp=2" in err, err
        assert not (tmp_path / "out").exists()
    out = convert(capsys, src, tmp_path / "hf_modules", "--to", "megatron", "--tp", 2, "--megatron-vision", "hf")
    assert_same_tensors(src, convert(capsys, out, tmp_path / "back", "--to", "hf"))


@pytest.mark.parametrize("family,vision,words", [("gemma3", "native", "NeMo 2"),
                                                 ("llava", "hf", "no framework reads")])
def test_megatron_vision_layouts_no_framework_builds_are_refused(hub, tmp_path, capsys, family, vision, words):
    code, _, err = run_cli(capsys, "convert", hub(family), tmp_path / "out", "--to", "megatron",
                           "--megatron-vision", vision)
    assert code == 2 and words in err


def test_layouts_without_towers_refuse_a_vlm(hub, tmp_path, capsys):
    for to in ("meta", "trtllm", "torchtitan"):
        code, _, err = run_cli(capsys, "convert", hub("qwen2_5_vl"), tmp_path / to, "--to", to)
        assert code == 2 and "vision" in err and not (tmp_path / to).exists()
