"""What trainers send the operator, and what peers send a rank, can be anything: generated
inputs at and beyond every limit end in a verdict, never in an exception that would stop a
reconcile pass, a rendezvous or a restart request.

Paths: progress reports (operator <- rank 0), termination messages (operator <- the pod's
status), worlds (rank <- the operator's restart request), rendezvous hellos (rank 0 <- any
pod that can reach it) and TokenReview answers (rank 0 <- the API server).
"""

from __future__ import annotations

import json
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tardigrade_contract import contract
from tardigrade_sdk import distributed, peerauth

from tests.fuzz import CHEAP, deep_json, json_values

pytestmark = pytest.mark.fuzz

anything = st.one_of(
    st.text(max_size=300),
    st.binary(max_size=300).map(lambda b: b.decode("latin-1")),
    json_values().map(json.dumps),
    deep_json(max_depth=20_000).map(lambda d: d[0]),
    # A flat record with each field's value drawn from anything JSON can hold.
    st.dictionaries(st.sampled_from(["reason", "step", "checkpoint_step", "message",
                                     "attempt", "loss", "checkpoint_time", "total_steps",
                                     "process_id", "job", "coordinator", "num_processes"]),
                    json_values(3)).map(json.dumps),
)


@CHEAP
@given(anything)
def test_a_termination_message_is_read_or_ignored(text):
    message = contract.TerminationMessage.from_json(text)
    assert message is None or isinstance(message.reason, str)


@CHEAP
@given(anything)
def test_a_progress_report_is_read_or_malformed(text):
    try:
        report = contract.ProgressReport.from_json(text)
    except contract.MalformedReport:
        return
    assert isinstance(report.step, int) and report.step >= 0


@CHEAP
@given(anything)
def test_a_world_is_read_or_refused_with_a_reason(text):
    try:
        world = contract.parse_world(text)
    except contract.ContractError as err:
        assert str(err)
        return
    assert all(isinstance(v, str) for v in world.values())


@CHEAP
@given(anything, st.booleans())
def test_a_hello_takes_a_rank_or_is_refused(text, newline):
    expect = {"job": "j", "attempt": 1, "num_processes": 4}
    mine, theirs = socket.socketpair()
    try:
        peers: dict[int, socket.socket] = {}
        raw = text.encode("utf-8", "surrogatepass") + (b"\n" if newline else b"")
        took = distributed._accept_hello(mine, raw, expect, 4, peers)
        hello = json.loads(text) if took else None
        assert not took or (isinstance(hello, dict) and all(
            hello.get(k) == v for k, v in expect.items()))
    finally:
        for sock in (mine, theirs):
            sock.close()


@CHEAP
@given(st.integers(200, 299), anything,
       st.dictionaries(st.sampled_from(["authenticated", "audiences", "user", "error"]),
                       json_values(4)))
def test_a_token_review_answer_is_a_verdict(code, text, status):
    access = peerauth.ApiAccess("https://127.0.0.1:1", "token")
    for answer in (text, json.dumps({"status": status})):
        verdict = peerauth.review(access, "t", post=lambda *_, a=answer: (code, a.encode(
            "utf-8", "surrogatepass")))
        assert isinstance(verdict, dict)
        why = peerauth.rejection(verdict, "ml", "job", 1)
        assert why is None or isinstance(why, str)


@pytest.mark.parametrize("status", [
    # Found by the property above: rejection() raised TypeError in the review thread.
    {"authenticated": True, "audiences": True},
    {"authenticated": True, "audiences": [peerauth.RENDEZVOUS_AUDIENCE], "user": ["x"]},
    {"authenticated": True, "audiences": [peerauth.RENDEZVOUS_AUDIENCE],
     "user": {"username": "system:serviceaccount:ml:x", "extra": 3}},
    {"authenticated": True, "audiences": [peerauth.RENDEZVOUS_AUDIENCE],
     "user": {"username": "system:serviceaccount:ml:x",
              "extra": {peerauth.POD_NAME_EXTRA: "job-a1-1"}}},
])
def test_a_review_answer_of_another_shape_refuses_the_hello(status):
    assert peerauth.rejection(status, "ml", "job", 1)
