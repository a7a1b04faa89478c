"""The request parser under fuzzing (issue #14, item 9): whatever the bytes, `decode_request` and
`check_request` either accept the request or raise an `APIError` with a 4xx, never anything else."""

from __future__ import annotations

import json

import hypothesis
from hypothesis import strategies as st

from engines.api.errors import APIError
from engines.api.protocol import ChatCompletionRequest, CompletionRequest
from engines.api.rules import check_request, decode_request
from gateway.budgets import check_amplification, prompt_count, worst_case_output
from gateway.config import PolicyConfig

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30,
)
FIELDS = {
    "model": st.text(max_size=10) | JSON_VALUES,
    "messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool", "x"]), "content": JSON_VALUES}),
        max_size=3,
    ) | JSON_VALUES,
    "prompt": JSON_VALUES,
    "max_tokens": st.integers(-5, 2**40) | JSON_VALUES,
    "n": st.integers(-2, 200) | JSON_VALUES,
    "temperature": st.floats() | JSON_VALUES,
    "stream": JSON_VALUES,
    "stream_options": JSON_VALUES,
    "stop": JSON_VALUES,
    "logprobs": JSON_VALUES,
}
BODIES = st.fixed_dictionaries({}, optional=FIELDS).map(lambda d: json.dumps(d).encode()) | st.binary(max_size=200)


def _parse(body: bytes, kind: type) -> None:
    try:
        request = decode_request(body, kind)
        check_request(request)
        check_amplification(request, PolicyConfig())
        assert prompt_count(request) >= 1 and worst_case_output(request) >= 0
    except APIError as exc:
        assert 400 <= exc.status_code < 500 and exc.message


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(BODIES)
def test_any_chat_body_is_accepted_or_a_clear_4xx(body: bytes) -> None:
    _parse(body, ChatCompletionRequest)


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(BODIES)
def test_any_completion_body_is_accepted_or_a_clear_4xx(body: bytes) -> None:
    _parse(body, CompletionRequest)
