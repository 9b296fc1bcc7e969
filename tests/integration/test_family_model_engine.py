"""The tiny Qwen3-architecture model on the real Qwen3 vocabulary loads and serves in the real vLLM CPU engine.

`family_engine_probe.py` runs in the worker venv (the same spec the worker uses), loads the model
folder with the worker's CPU engine arguments and prints what it serves. Asserted: the ids vLLM's
own tokenizer renders from the folder's chat template equal `renderers`' qwen3 `render_ids` for
the same request (so stock vLLM serves the renderer's prompt), and every greedy token the engine
samples is the argmax of the transformers model on the same prefix, up to float32 numerics.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from renderers import Qwen3RendererConfig, create_renderer
from transformers import AutoModelForCausalLM

from examples.families.qwen3_model import Qwen3TinyConfig, ensure_qwen3_tiny_model
from examples.families.vocab import QWEN3, load_family_tokenizer
from nemo_rl.utils.venvs import REPO_ROOT, ensure_venv, venv_python, vllm_spec

pytestmark = pytest.mark.integration

PROBE = REPO_ROOT / "tests" / "integration" / "family_engine_probe.py"
PROBE_TIMEOUT_S = 600
LOGIT_TOLERANCE = 1e-3
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}
REQUEST = {
    "messages": [
        {"role": "system", "content": "Use the calculator tool, then state the answer."},
        {"role": "user", "content": "What is 14 + 11 * 4?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "14 + 11 * 4"}}}
        ]},
        {"role": "tool", "tool_call_id": "call_0", "content": "58"},
    ],
    "tools": [CALCULATOR],
    "enable_thinking": False,
    "max_tokens": 8,
}


@pytest.mark.timeout(1800)
def test_tiny_qwen3_model_serves_in_the_vllm_cpu_engine(tmp_path):
    model_dir = ensure_qwen3_tiny_model(Qwen3TinyConfig())
    request_path = tmp_path / "request.json"
    request_path.write_text(json.dumps(REQUEST))
    python = venv_python(ensure_venv(vllm_spec("cpu")))
    proc = subprocess.run(
        [str(python), str(PROBE), str(model_dir), str(request_path)],
        capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"probe exited {proc.returncode}\n{proc.stderr[-6000:]}"
    served = json.loads(lines[-1])

    tokenizer = load_family_tokenizer(QWEN3)
    renderer = create_renderer(tokenizer, Qwen3RendererConfig(enable_thinking=False))
    prompt = renderer.render_ids(REQUEST["messages"], tools=REQUEST["tools"], add_generation_prompt=True)
    assert served["template_ids"] == prompt
    # <|im_start|>assistant\n<think>\n\n</think>\n\n: the prefilled empty think block of thinking off.
    assert prompt[-7:] == [151644, 77091, 198, 151667, 271, 151668, 271]

    output = served["output_ids"]
    assert len(output) == REQUEST["max_tokens"]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for step, token in enumerate(output):
            logits = model(torch.tensor([prompt + output[:step]])).logits[0, -1]
            assert 0 <= token < 151936
            assert float(logits[token]) >= float(logits.max()) - LOGIT_TOLERANCE, f"step {step}: {token} is not greedy"
