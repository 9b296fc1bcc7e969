"""The run-output checks of `tests/integration/log_checks.py` flag the lines they exist for.

The vLLM lines below are copied from a real run of the README main command before the worker
rendered its engine inputs (vLLM 0.32, forwarded by Ray from the worker actor), so a check that
stopped matching vLLM's wording would fail here, not pass silently on the L1 legs.
"""

from __future__ import annotations

from tests.integration.log_checks import raw_prompt_warnings, reload_failed_warnings, vllm_main_process_warnings

PREFIX = "\x1b[36m(VllmGenerationWorker pid=3208)\x1b[0m (MainProcess pid=3208) WARNING 12-03 15:59:"
SEED_LINE = (PREFIX + "40 [arg_utils.py:1945] The global random seed is set to 0. Since VLLM_ENABLE_V1_MULTIPROCESSING "
             "is set to False, this may affect the random state of the Python process that launched vLLM.")
RAW_PROMPT_LINE = (PREFIX + "58 [input_processor.py:408] Passing raw prompts to InputProcessor is deprecated and will "
                   "be removed in the future. You should instead pass the outputs of Renderer.render_cmpl() or "
                   "Renderer.render_chat().")
ENGINE_CORE_LINE = ("\x1b[36m(VllmGenerationWorker pid=3208)\x1b[0m (EngineCore pid=3348) WARNING 12-03 16:00:24 "
                    "[layerwise.py:266] RotaryEmbedding: Failed to load weights")


def test_a_raw_prompt_is_flagged_and_a_rendered_run_is_not() -> None:
    before = "\n".join([SEED_LINE, RAW_PROMPT_LINE, ENGINE_CORE_LINE])
    after = "\n".join([SEED_LINE, ENGINE_CORE_LINE])
    assert raw_prompt_warnings(before) == [RAW_PROMPT_LINE]
    assert raw_prompt_warnings(after) == []
    # what makes the empty answer mean something: the worker's own vLLM warnings reach the text
    assert vllm_main_process_warnings(after) == [SEED_LINE]
    assert vllm_main_process_warnings(ENGINE_CORE_LINE) == []


def test_a_reload_warning_is_found_in_a_real_line_and_nowhere_else() -> None:
    assert reload_failed_warnings("\n".join([SEED_LINE, ENGINE_CORE_LINE, RAW_PROMPT_LINE])) == [ENGINE_CORE_LINE]
    assert reload_failed_warnings("\n".join([SEED_LINE, RAW_PROMPT_LINE])) == []
