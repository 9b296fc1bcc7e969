"""`ApiError`: the status follows from the type, and the body is the OpenAI error body both transports send.

`error_name`: what a detail or a log line calls an error, its kind included.
"""

from __future__ import annotations

import json

import pytest

from nemo_rl.data.errors import STATUS_OF, ApiError, RecordInvariantError, error_name
from nemo_rl.data_plane.errors import DataPlaneError, MissingKeysError


def test_the_status_follows_from_the_type_and_the_body_is_openai_shaped() -> None:
    error = ApiError("prefix_mismatch", "staging_chain of call c2: no", param="ng_capture.staging_chain")
    assert (error.status, error.err_type, error.message, error.param, str(error)) == (
        409, "prefix_mismatch", "staging_chain of call c2: no", "ng_capture.staging_chain", "staging_chain of call c2: no",
    )
    body = {"error": {"message": "staging_chain of call c2: no", "type": "prefix_mismatch",
                      "param": "ng_capture.staging_chain", "code": 409}}
    assert error.body() == body
    assert error.encoded() == json.dumps(body).encode()  # what aiohttp's json_response sends for body()
    assert ApiError("worker_starting", "starting").body()["error"]["param"] is None


def test_every_type_has_one_status_and_an_unknown_type_is_the_raisers_bug() -> None:
    assert {ApiError(t, "m").status for t in STATUS_OF} <= {400, 401, 403, 409, 413, 500, 502, 503}
    with pytest.raises(ValueError, match="unknown API error type 'no_such_error'"):
        ApiError("no_such_error", "m")


def test_an_error_is_named_by_its_class_and_its_kind_if_it_has_one() -> None:
    # A member class of its own already names its kind; its family base names the kind.
    assert error_name(MissingKeysError("staging", ["r1/a"], ["tokens"], operation="get")) == "MissingKeysError"
    assert error_name(DataPlaneError("the controller is gone", kind="unavailable")) == "DataPlaneError[unavailable]"
    assert error_name(RecordInvariantError("TrainRow r#0: token_ids must be non-negative ints", kind="row")) == (
        "RecordInvariantError[row]"
    )
    assert error_name(ApiError("worker_starting", "starting")) == "ApiError"
    assert error_name(KeyError("x")) == "KeyError"
