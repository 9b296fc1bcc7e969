"""Run in the vLLM worker venv: load a model folder in the real vLLM CPU engine, print what it serves.

Usage: `python family_engine_probe.py <model_dir> <request.json>`; the request holds `messages`,
`tools`, `enable_thinking` and `max_tokens`. Prints one JSON line: the ids vLLM's own tokenizer
renders from the folder's chat template (`template_ids`), and the greedy completion ids the engine
samples after them (`output_ids`). Engine arguments follow the worker's CPU ones (float32, the
"uni" executor, an exact KV budget, eager).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"})

from vllm import LLM, SamplingParams  # noqa: E402 (the environment must be set before vLLM is imported)


def main(model_dir: str, request_path: str) -> None:
    request = json.loads(open(request_path).read())
    llm = LLM(
        model=model_dir, tokenizer=model_dir, dtype="float32", seed=0, enforce_eager=True, max_model_len=2048,
        kv_cache_memory_bytes=64 * 1024 * 1024, distributed_executor_backend="uni",
    )
    template_ids = list(llm.get_tokenizer().apply_chat_template(
        request["messages"], tools=request["tools"], add_generation_prompt=True, tokenize=True,
        return_dict=False, enable_thinking=request["enable_thinking"],
    ))
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": template_ids}], params)[0]
    print(json.dumps({"template_ids": template_ids, "output_ids": list(out.outputs[0].token_ids)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
