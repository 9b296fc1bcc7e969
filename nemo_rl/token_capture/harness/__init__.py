"""Helpers for driving the capture stack the way external agent harnesses do (examples, tests).

`exactness.check_rows_exact` compares judged rows with the engine's own sampling records.
"""

from nemo_rl.token_capture.harness.exactness import CallCheck, ExactnessReport, check_rows_exact

__all__ = ["CallCheck", "ExactnessReport", "check_rows_exact"]
