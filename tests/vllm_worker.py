"""Run by test_vllm_load.py under the vLLM CPU environment (``RESHARD_VLLM_PYTHON``), never imported by pytest.

Loads a ``sharded_state`` folder with vLLM itself and writes the prompt logprobs it computes for fixed token ids:

    python vllm_worker.py MODEL_DIR TP REQUEST.json RESULT.json

REQUEST.json: ``{"prompts": [[token ids], ...], "top_k": K, "enable_expert_parallel": bool, "load_format": str}``
(the last two optional: default false and ``sharded_state``; ``reshard`` is the load format reshard's vLLM plugin
registers, found by vLLM through the installed package's entry point). RESULT.json: ``{"prompts": [[position entries]]}``, one entry per prompt position from 1 on, each
``{token id: logprob}`` (the actual next token plus vLLM's top K).
Imports only vllm (and what it imports); reshard only through vLLM's plugin entry point.
"""

from __future__ import annotations

import json
import sys


def main(model_dir: str, tp: int, request_path: str, result_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request = json.load(open(request_path))
    llm = LLM(model=model_dir, load_format=request.get("load_format", "sharded_state"), tensor_parallel_size=tp, dtype="float32",
              skip_tokenizer_init=True, enforce_eager=True, max_model_len=128, max_num_seqs=4, seed=0,
              enable_expert_parallel=bool(request.get("enable_expert_parallel", False)))
    params = SamplingParams(prompt_logprobs=request["top_k"], max_tokens=1, temperature=0.0, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]], params)
    prompts = []
    for out in outputs:
        positions = out.prompt_logprobs[1:]  # position 0 has no logprob (nothing predicts the first token)
        prompts.append([{str(tok): lp.logprob for tok, lp in entry.items()} for entry in positions])
    with open(result_path, "w") as f:
        json.dump({"prompts": prompts}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
