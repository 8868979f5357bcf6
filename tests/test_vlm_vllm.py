"""vLLM itself loads reshard's vision-language ``sharded_state`` output (opt-in, heavy; issue 35):

- the tiny LLaVA of vlm_cases.py (Llama text model with hidden 128, head_dim 32: vLLM CPU's attention rejects 16;
  CLIP tower of 3 layers read up to ``vision_feature_layer=-2``) in the Hub spelling, converted with
  ``reshard convert HF OUT --to vllm --tp N`` and loaded with ``LLM(load_format="sharded_state",
  tensor_parallel_size=N, limit_mm_per_prompt={"image": 1})`` at N = 1 and 2: the prompt logprobs of an image
  prompt (and of text prompts) within 1e-4 of transformers';
- the tiny Qwen2.5-VL (text hidden 128, mrope_section [4, 6, 6]) converted with ``--vllm-vision none`` (no
  vision tower: an engine with ``limit_mm_per_prompt={"image": 0, "video": 0}`` builds none, and the
  sharded_state loader refuses tensors the model lacks) and loaded that way: text prompt logprobs likewise.

The HF folders carry what vLLM's processors need (made here, offline): a WordLevel tokenizer with the special
tokens at the config's ids, ``preprocessor_config.json`` and ``processor_config.json`` (probes/vlm/make_tokenizer.py);
reshard must carry them into its output. vLLM runs in one subprocess per TP (tests/vlm_vllm_worker.py) that loads
both models one after the other, under ``RESHARD_VLLM_PYTHON`` with tests/vlm_shim on PYTHONPATH (the vLLM venv
has no CPU torchvision; the shim serves transformers' torchvision image processors from their PIL siblings).

The HF reference runs here, in transformers 5.24 (the version under test, which wrote the folders), on the token
ids vLLM's processor expanded the image prompt to and on the very tensors (``pixel_values``) vLLM's processor
made for the image and fed its tower (the worker records them): the comparison is about the weights, not about two
image processors. The image is checked to matter (transformers' logprobs with a blank image differ).

Development check of the harness itself, without reshard: ``python tests/test_vlm_vllm.py --vllm-saved [TP ...]``
feeds vLLM per-rank files that vLLM's own loader made from the HF folders (:func:`vllm_saved_folders`) and prints
the worst difference per case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vlm_cases
from cli_inprocess import run_main
from test_vllm_load import ENV_VAR, TOLERANCE, removing_inductor_caches, tp_threads, vllm_env
from test_vllm_load import no_inductor_cache_left  # noqa: F401  (autouse: what vLLM's processes leave goes too)

pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent
WORKER = HERE / "vlm_vllm_worker.py"
SHIM = HERE / "vlm_shim"
TEXT_HIDDEN = 128
TOP_K = 5
SETUP = (f"set {ENV_VAR} to the python of a virtual environment holding the CPU build of vLLM 0.32 "
         f"(see tests/test_vllm_load.py), e.g. `{ENV_VAR}=/work/vllm-venv/bin/python python -m pytest -m vllm "
         "tests/test_vlm_vllm.py`")
# Loader warnings the sharded_state loader prints instead of failing: a narrowed shape or a cast dtype.
LOADER_WARNINGS = ("loading tensor of shape", "Attempted to load weight")
JOB_MARK = "=== vlm_vllm_worker job "

# The special tokens each tokenizer holds at the config's ids (make_tokenizer.py), and its pad / eos / bos / unk.
SPECIAL = {
    "llava": {"<unk>": 0, "<s>": 1, "</s>": 2, "<image>": 260},
    "qwen2_5_vl": {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|image_pad|>": 151,
                   "<|video_pad|>": 152, "<|vision_start|>": 153, "<|vision_end|>": 154},
}
ROLES = {"llava": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
         "qwen2_5_vl": {"pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"}}
# CLIP: shortest edge 28, centre crop 28 (the tower's image_size); Qwen: 56 x 56 pixels -> 4 x 4 patches of 14.
PREPROCESSOR = {
    "llava": {"image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
              "crop_size": {"height": 28, "width": 28}, "size": {"shortest_edge": 28}, "do_center_crop": True,
              "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
    "qwen2_5_vl": {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
                   "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 56 * 56,
                   "max_pixels": 56 * 56, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                   "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True},
}
PROCESSOR = {
    "llava": {"processor_class": "LlavaProcessor", "patch_size": 14, "vision_feature_select_strategy": "default",
              "image_token": "<image>"},
    "qwen2_5_vl": {"processor_class": "Qwen2_5_VLProcessor"},
}
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")

# name -> what is converted and asked. Token prompts end near the vocab end (LLaVA 300 -> vLLM pads to 320, Qwen
# 160 -> 192), next to the padding rows vLLM must ignore.
CASES = {
    "llava": dict(family="llava", limits={"image": 1}, convert_args=(),
                  token_prompts=[vlm_cases.TEXT_IDS["llava"], [1, 17, 42, 42, 8, 200, 133, 64, 298, 3]],
                  # expands to vlm_cases.LLAVA_IDS: <image> becomes (28 / 14)^2 = 4 image tokens (CLS dropped)
                  image_prompt="<s> w5 <image> w7 w9 w11", image_ids=vlm_cases.LLAVA_IDS, image_size=56),
    "qwen2_5_vl_text": dict(family="qwen2_5_vl", limits={"image": 0, "video": 0},
                            convert_args=("--vllm-vision", "none"),
                            token_prompts=[vlm_cases.TEXT_IDS["qwen2_5_vl"], [1, 17, 42, 42, 8, 100, 133, 64, 158, 3]]),
}
#: the same LLaVA case served from its HF folder as it is, through reshard's vLLM plugin (load_format="reshard")
PLUGIN = "llava_plugin"


# ---- the HF folders ----------------------------------------------------------------------------------------------

def write_processor_files(folder: Path, family: str) -> None:
    """An offline WordLevel tokenizer (whitespace split; ``w{i}`` is token i, the family's special tokens at their
    config ids) plus ``preprocessor_config.json`` / ``processor_config.json``, as probes/vlm/make_tokenizer.py."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = SPECIAL[family]
    vocab_size = vlm_cases.config_of(folder)["text_config"]["vocab_size"]
    vocab = {f"w{i}": i for i in range(vocab_size)}
    for token, i in special.items():
        del vocab[f"w{i}"]
        vocab[token] = i
    unk = next(t for t, i in special.items() if i == 0)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(special))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **ROLES[family])
    fast.save_pretrained(str(folder))
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR[family], indent=1))
    (folder / "processor_config.json").write_text(json.dumps(PROCESSOR[family], indent=1))


def make_hf_folders(root: Path) -> dict[str, Path]:
    """name -> the Hub-spelling HF folder of each case (``vlm_cases.save_hub(family, ..., text_hidden=128)``) with
    its tokenizer and processor files."""
    folders = {}
    for name, case in CASES.items():
        folder = vlm_cases.save_hub(case["family"], root / f"hf-{name}", text_hidden=TEXT_HIDDEN)
        write_processor_files(folder, case["family"])
        folders[name] = folder
    return folders


# ---- the folders vLLM loads ---------------------------------------------------------------------------------------

def reshard_folders(hf: dict[str, Path], root: Path, tp: int) -> dict[str, Path | str]:
    """name -> reshard's vLLM output at ``tp`` (``reshard convert HF OUT --to vllm --tp N`` + the case's options),
    or the reason it cannot be loaded (the convert failed, or it lacks a processor file)."""
    out = {}
    for name, case in CASES.items():
        dst = root / f"reshard-{name}-tp{tp}"
        proc = run_main("convert", hf[name], dst, "--to", "vllm", "--tp", tp, *case["convert_args"])
        if proc.returncode != 0:
            out[name] = (f"`reshard convert {hf[name].name} --to vllm --tp {tp} {' '.join(case['convert_args'])}` "
                         f"exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            continue
        missing = [f for f in PROCESSOR_FILES if "image_prompt" in case and not (dst / f).is_file()]
        out[name] = (f"reshard's output {dst} lacks {', '.join(missing)}, which the source folder has: vLLM cannot "
                     "start a LLaVA engine without them (its multimodal profiling builds the HF processor; "
                     "OSError: Can't load image processor)") if missing else dst
    return out


def worker_env(tp: int, workdir: Path, tag: str) -> dict[str, str]:
    """The worker's environment (test_vllm_load.vllm_env at ``tp`` ranks, plus the torchvision shim on PYTHONPATH)."""
    return vllm_env(workdir, tag, **tp_threads(tp), PYTHONPATH=str(SHIM), VLLM_DIST_IDENT=f"reshard-vlm-{tag}")


def vllm_saved_folders(python: str, hf: dict[str, Path], root: Path, tp: int) -> dict[str, Path]:
    """Development only (no reshard): name -> per-rank ``sharded_state`` files vLLM's own loader made from the HF
    folder at ``tp`` for the case's engine (``limit_mm_per_prompt`` as the case's: Qwen's text-only engine has no
    tower), plus the HF folder's side files. What reshard's output has to equal, to prove the harness."""
    root.mkdir(parents=True, exist_ok=True)
    folders = {name: root / f"vllm-saved-{name}-tp{tp}" for name in CASES}
    request = root / f"save-tp{tp}.json"
    request.write_text(json.dumps({"jobs": [{"model": str(hf[n]), "out": str(folders[n]), "limits": CASES[n]["limits"]}
                                            for n in CASES]}))
    with removing_inductor_caches():
        proc = subprocess.run([python, str(WORKER), "save", str(tp), str(request)], env=worker_env(tp, root, f"save{tp}"),
                              capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"vLLM's save at tp {tp} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return folders


def launch(python: str, folders: dict[str, Path], tp: int, workdir: Path) -> dict[str, dict]:
    """One worker at ``tp`` loading each folder with ``load_format="sharded_state"``: name -> its result (see
    vlm_vllm_worker.py) plus ``log`` (what the worker printed during that job) and ``dir`` (where its files are)."""
    workdir.mkdir(parents=True, exist_ok=True)
    jobs = []
    for name, folder in folders.items():
        case = CASES["llava" if name == PLUGIN else name]
        job = {"name": name, "model": str(folder), "limits": case["limits"], "top_k": TOP_K,
               "token_prompts": case["token_prompts"], "image_prompts": [],
               "load_format": "reshard" if name == PLUGIN else "sharded_state"}
        if "image_prompt" in case:
            job["image_prompts"] = [{"prompt": case["image_prompt"], "image_seed": 0, "image_size": case["image_size"]}]
        jobs.append(job)
    request, result = workdir / f"request-tp{tp}.json", workdir / f"result-tp{tp}.json"
    request.write_text(json.dumps({"jobs": jobs}))
    with removing_inductor_caches():
        proc = subprocess.run([python, str(WORKER), "run", str(tp), str(request), str(result)],
                              env=worker_env(tp, workdir, f"tp{tp}"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=1800)
    log = proc.stdout  # stdout and stderr in one stream, in the order written: job_log splits it
    results = json.loads(result.read_text()) if result.is_file() else {}
    for name in folders:
        entry = results.setdefault(name, {"error": f"the worker exited {proc.returncode} before this job ended:\n"
                                                   f"{job_log(log, name)[-8000:]}"})
        entry["log"] = job_log(log, name)
        entry["dir"] = str(workdir)
    return results


def job_log(log: str, name: str) -> str:
    """The part of the worker's output printed while job ``name`` ran (between its start mark and the next)."""
    start = log.find(JOB_MARK + name + "\n")
    if start < 0:
        return log
    end = log.find(JOB_MARK, start + 1)
    return log[start:end if end >= 0 else len(log)]


# ---- the comparison ----------------------------------------------------------------------------------------------

def hf_logprobs(model, **inputs) -> torch.Tensor:
    """transformers' fp32 log-softmax (in fp64); row i is the distribution of token i + 1."""
    with torch.no_grad():
        logits = model(**inputs).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def compare(want: torch.Tensor, ids: list[int], positions: list[dict], vocab_size: int, label: str) -> float:
    """vLLM's prompt logprobs (per position: the actual next token and vLLM's top K) against transformers' ``want``:
    every one within TOLERANCE, every top-K token in transformers' top K, no padding row; returns the worst diff."""
    assert len(positions) == len(ids) - 1, f"{label}: {len(positions)} positions for {len(ids)} tokens"
    worst = 0.0
    for i, entry in enumerate(positions):
        row = want[i]
        assert str(ids[i + 1]) in entry, f"{label}: vLLM gave no logprob for the actual token at position {i + 1}"
        assert TOP_K <= len(entry) <= TOP_K + 1, f"{label} position {i + 1}: {len(entry)} entries"
        kth = torch.topk(row, TOP_K).values[-1].item()
        for tok, logprob in entry.items():
            tok = int(tok)
            assert 0 <= tok < vocab_size, f"{label}: vLLM ranked padding row {tok}"
            diff = abs(logprob - row[tok].item())
            assert diff <= TOLERANCE, f"{label} position {i + 1} token {tok}: |vLLM - transformers| = {diff:.3g}"
            worst = max(worst, diff)
            if tok != ids[i + 1]:
                assert row[tok].item() >= kth - TOLERANCE, f"{label}: token {tok} is not in transformers' top {TOP_K}"
    return worst


def check_case(name: str, hf_dir: Path, result: dict, tp: int) -> dict[str, float]:
    """Every prompt of case ``name`` as vLLM ran it at ``tp`` against transformers on ``hf_dir``: label -> worst
    diff. Fails on a worker error or a loader warning."""
    assert "error" not in result, f"vLLM failed on {name} at tp {tp}:\n{result['error'][-8000:]}"
    for warning in LOADER_WARNINGS:
        lines = [line for line in result["log"].splitlines() if warning in line]
        assert not lines, f"vLLM warned while loading {name} at tp {tp}:\n" + "\n".join(lines[:20])
    case = CASES[name]
    model = vlm_cases.load(hf_dir, case["family"])
    vocab_size = model.config.text_config.vocab_size
    worst = {}
    for k, (ids, positions) in enumerate(zip(case["token_prompts"], result["token_prompts"], strict=True)):
        want = hf_logprobs(model, input_ids=torch.tensor([ids]))
        worst[f"text{k}"] = compare(want, ids, positions, vocab_size, f"{name} tp={tp} text prompt {k}")
    if "image_prompt" in case:
        (image,) = result["image_prompts"]
        ids = image["prompt_token_ids"]
        assert ids == case["image_ids"], f"vLLM's processor expanded {case['image_prompt']!r} to {ids}"
        image_token = model.config.image_token_id
        assert (image["image_offset"], image["image_length"]) == (ids.index(image_token), ids.count(image_token))
        tensors = torch.load(Path(result["dir"]) / image["mm_kwargs"], weights_only=True)
        pixels = tensors["pixel_values"].float()
        if pixels.dim() == 3:
            pixels = pixels.unsqueeze(0)  # one image's item, without the batch axis
        size = model.config.vision_config.image_size
        assert pixels.shape == (1, 3, size, size), f"pixel_values {tuple(pixels.shape)}"
        want = hf_logprobs(model, input_ids=torch.tensor([ids]), pixel_values=pixels)
        blank = hf_logprobs(model, input_ids=torch.tensor([ids]), pixel_values=torch.zeros_like(pixels))
        effect = (want - blank).abs().max().item()
        assert effect > 100 * TOLERANCE, f"the image changes transformers' logprobs by only {effect:.3g}"
        worst["image"] = compare(want, ids, image["positions"], vocab_size, f"{name} tp={tp} image prompt")
    return worst


# ---- the tests ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_python() -> str:
    python = os.environ.get(ENV_VAR)
    if not python:
        pytest.skip(f"{ENV_VAR} is not set: {SETUP}")
    if not os.access(python, os.X_OK):
        pytest.fail(f"{ENV_VAR}={python} is not an executable: {SETUP}", pytrace=False)
    return python


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory, vllm_python) -> dict[str, Path]:
    return make_hf_folders(tmp_path_factory.mktemp("vlm-hf"))


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory, vllm_python, hf_folders):
    """tp -> (name -> reshard's folder or why there is none, name -> vLLM's result): one conversion of each case
    and one vLLM launch (every loadable case) per TP, shared by the tests at that TP."""
    done: dict[int, tuple[dict, dict]] = {}

    def at(tp: int):
        if tp not in done:
            root = tmp_path_factory.mktemp(f"vlm-vllm-tp{tp}")
            folders = reshard_folders(hf_folders, root, tp)
            loadable = {n: f for n, f in folders.items() if isinstance(f, Path)}
            loadable[PLUGIN] = folders[PLUGIN] = hf_folders["llava"]
            done[tp] = folders, (launch(vllm_python, loadable, tp, root / "run") if loadable else {})
        return done[tp]

    with removing_inductor_caches():
        yield at


def run_case(vllm_runs, hf_folders, name: str, tp: int) -> dict[str, float]:
    folders, results = vllm_runs(tp)
    if not isinstance(folders[name], Path):
        pytest.fail(folders[name], pytrace=False)
    case = "llava" if name == PLUGIN else name
    worst = check_case(case, hf_folders[case], results[name], tp)
    print(f"\n{name} tp={tp}: max |vLLM - transformers| prompt logprob: "
          + ", ".join(f"{k} {v:.3g}" for k, v in worst.items()))
    return worst


@pytest.mark.parametrize("tp", [1, 2])
def test_llava_served_from_hf_by_the_plugin(vllm_runs, hf_folders, tp):
    """The HF LLaVA folder as it is, ``load_format="reshard"``: every worker builds its rank with reshard.load_rank;
    the image prompt's logprobs within 1e-4 of transformers'."""
    assert "image" in run_case(vllm_runs, hf_folders, PLUGIN, tp)


@pytest.mark.parametrize("tp", [1, 2])
def test_llava_image_prompt(vllm_runs, hf_folders, tp):
    """reshard's LLaVA at TP ``tp``: an image prompt's (and text prompts') logprobs within 1e-4 of transformers'."""
    worst = run_case(vllm_runs, hf_folders, "llava", tp)
    assert "image" in worst


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen25_text_only(vllm_runs, hf_folders, tp):
    """reshard's Qwen2.5-VL written with ``--vllm-vision none`` at TP ``tp``, served text-only: logprobs within
    1e-4 of transformers'."""
    run_case(vllm_runs, hf_folders, "qwen2_5_vl_text", tp)


def _vllm_saved_main(tps: list[int]) -> None:
    """``python tests/test_vlm_vllm.py --vllm-saved [TP ...]``: the same launch and comparison on folders vLLM's own
    loader wrote (:func:`vllm_saved_folders`), no reshard; prints the worst diff per case and prompt."""
    import tempfile

    python = os.environ.get(ENV_VAR) or sys.exit(f"{ENV_VAR} is not set: {SETUP}")
    with tempfile.TemporaryDirectory(prefix="vlm-vllm-dev-") as tmp:
        root = Path(tmp)
        hf = make_hf_folders(root)
        for tp in tps:
            folders = vllm_saved_folders(python, hf, root / f"saved-tp{tp}", tp)
            results = launch(python, folders, tp, root / f"run-tp{tp}")
            for name in CASES:
                worst = check_case(name, hf[name], results[name], tp)
                print(f"vLLM-saved {name} tp={tp}: " + ", ".join(f"{k} {v:.3g}" for k, v in worst.items()), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--vllm-saved"]:
        sys.exit("usage: python tests/test_vlm_vllm.py --vllm-saved [TP ...]  (the tests run under pytest -m vllm)")
    _vllm_saved_main([int(t) for t in sys.argv[2:]] or [1, 2])
