"""audit_row / retokenization_drift on hand-built rows (exact expectations)."""

from __future__ import annotations

from nemo_gym.token_id_capture.staging import CallRecord, LinearizedRow

from nemo_rl.token_capture.audit import audit_row, retokenization_drift


def _record(call_id: str, response_id: str) -> CallRecord:
    return CallRecord.model_construct(model_call_id=call_id, response_id=response_id)


ROW = LinearizedRow(
    rollout_id="r",
    token_ids=[1, 2, 3, 10, 11, 4, 5, 12],
    token_mask=[0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0],
    logprobs=[0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3],
    model_call_ids=["a", "b"],
    prompt_len=3,
    weight_versions=[0, 0],
    weight_version_spans=[],
    link_spans=[("a", 3, 2), ("b", 2, 1)],
)
RECORDS = [_record("a", "chatcmpl-a"), _record("b", "chatcmpl-b")]


def _engine(**over):
    engine = {
        "chatcmpl-a": {"prompt_token_ids": [1, 2, 3], "token_ids": [10, 11], "logprobs": [-0.1, -0.2]},
        "chatcmpl-b": {"prompt_token_ids": [1, 2, 3, 10, 11, 4, 5], "token_ids": [12], "logprobs": [-0.25]},
    }
    engine.update(over)
    return engine


def test_matching_row_passes_with_logprob_diff():
    audit = audit_row(ROW, RECORDS, _engine())
    assert audit.ids_match is True
    assert abs(audit.max_abs_logprob_diff - 0.05) < 1e-12
    assert [c.model_call_id for c in audit.calls] == ["a", "b"]


def test_wrong_sampled_id_or_prompt_or_missing_record_fails():
    bad_ids = _engine(**{"chatcmpl-b": {"prompt_token_ids": [1, 2, 3, 10, 11, 4, 5], "token_ids": [13], "logprobs": [-0.3]}})
    assert audit_row(ROW, RECORDS, bad_ids).ids_match is False
    bad_prompt = _engine(**{"chatcmpl-b": {"prompt_token_ids": [1, 2, 3, 10, 11, 5, 4], "token_ids": [12], "logprobs": [-0.3]}})
    assert audit_row(ROW, RECORDS, bad_prompt).ids_match is False
    missing = _engine()
    del missing["chatcmpl-a"]
    audit = audit_row(ROW, RECORDS, missing)
    assert audit.ids_match is False and audit.max_abs_logprob_diff == float("inf")


class _Tok:
    """Decodes id i to chr(96 + i); encodes greedily pairing 'ab' into id 27."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(96 + i) for i in ids)

    def encode(self, text, add_special_tokens=False):
        out, i = [], 0
        while i < len(text):
            if text[i : i + 2] == "ab":
                out.append(27)
                i += 2
            else:
                out.append(ord(text[i]) - 96)
                i += 1
        return out


def test_retokenization_drift():
    assert retokenization_drift(_Tok(), [3, 4]) is False
    assert retokenization_drift(_Tok(), [1, 2]) is True  # "ab" re-encodes as one merged id


def test_audit_train_row_checks_every_chain_of_a_judged_rollout(trees):
    from nemo_rl.token_capture.audit import audit_train_row
    from nemo_rl.token_capture.config import TokenCaptureConfig
    from nemo_rl.token_capture.judge import RolloutEvidence, judge_rollout

    rid = "audit-r1"
    tree = trees.build(rid, [
        trees.Call("c0", None, trees.Turn((1, 2), (3, 4), (-0.5, -0.25))),
        trees.Call("a", "c0", trees.Turn((5,), (6,), (-1.0,))),
        trees.Call("a2", "a", trees.Turn((11,), (12,), (-0.2,))),  # a fork the harness continued: trained
        trees.Call("b", "c0", trees.Turn((5,), (7, 8), (-0.1, -0.2))),
        trees.Call("c", "b", trees.Turn((9,), (10,), (-0.3,))),
    ])
    ev = RolloutEvidence(rid, 0, 0, trees.run_result(1.0, tree.by_id["c"].response_id), None, tree.manifest(), None,
                         None)
    kept = judge_rollout(ev, tree.snapshots_by_key, {}, TokenCaptureConfig())
    engine = {}
    for call_id, call in tree.calls.items():
        sequence = tree.sequences[call_id]
        generated = len(call.turn.generated)
        engine[tree.by_id[call_id].response_id] = {
            "prompt_token_ids": list(sequence[:-generated]), "token_ids": list(sequence[-generated:]),
            "logprobs": list(call.turn.logprobs)}

    audits = [audit_train_row(row, tree.records, engine) for row in kept.rows]
    assert [[c.model_call_id for c in audit.calls] for audit in audits] == [["c0", "b", "c"], ["c0", "a", "a2"]]
    assert all(audit.ids_match and audit.max_abs_logprob_diff == 0.0 for audit in audits)

    drifted = {**engine, tree.by_id["a"].response_id: {**engine[tree.by_id["a"].response_id], "token_ids": [11]}}
    off = {**engine, tree.by_id["b"].response_id: {**engine[tree.by_id["b"].response_id], "logprobs": [-0.1, -0.7]}}
    assert [audit_train_row(row, tree.records, drifted).ids_match for row in kept.rows] == [True, False]
    assert abs(audit_train_row(kept.rows[0], tree.records, off).max_abs_logprob_diff - 0.5) < 1e-12
    missing = {k: v for k, v in engine.items() if k != tree.by_id["c0"].response_id}
    audit = audit_train_row(kept.rows[1], tree.records, missing)
    assert (audit.ids_match, audit.max_abs_logprob_diff) == (False, float("inf"))
