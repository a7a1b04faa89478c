"""Nothing a client sends is silently dropped: every field of the installed `openai` SDK's chat and
completions requests has exactly one fate in `engines.api.fields`, and each fate does what it says."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from engines.api import fields
from engines.api.client import to_body
from engines.api.errors import APIError
from engines.api.fields import CHAT, COMPLETIONS, FORWARDED, HONOURED, REFUSED, Fate
from engines.api.protocol import ChatCompletionRequest, CompletionRequest
from engines.api.rules import check_request, decode_request

SDK_CHAT = set(chat_create_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
SDK_COMPLETIONS = set(completion_create_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
BASE_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
BASE_COMPLETION = {"model": "m", "prompt": "hi"}
SOMETHING = {"asks": "for something"}  # a value no forwarded or refused field treats as neutral


@pytest.mark.parametrize(("sdk_fields", "table", "struct"), [
    (SDK_CHAT, CHAT, ChatCompletionRequest), (SDK_COMPLETIONS, COMPLETIONS, CompletionRequest),
])
def test_every_sdk_field_has_exactly_one_fate_and_is_modelled(sdk_fields: set[str], table: dict[str, Fate],
                                                              struct: type) -> None:
    assert sdk_fields - set(table) == set(), "SDK request fields without a fate"
    assert all(isinstance(fate, Fate) for fate in table.values())  # a dict: one fate per name
    assert set(table) - set(struct.__struct_fields__) == set(), "fates for fields the wire schema drops"


def _decode(body: dict[str, Any], struct: type) -> Any:
    return decode_request(json.dumps(body).encode(), struct)


def _cases(table: dict[str, Fate], fate: Fate) -> list[str]:
    return sorted(name for name, f in table.items() if f is fate)


@pytest.mark.parametrize("name", _cases(CHAT, FORWARDED))
def test_a_forwarded_chat_field_reaches_http_tiers_untouched_and_our_engine_refuses_it(name: str) -> None:
    request = _decode({**BASE_CHAT, name: SOMETHING}, ChatCompletionRequest)
    check_request(request)  # the gateway lets it through to whichever tier
    assert json.loads(to_body(request, model="upstream"))[name] == SOMETHING
    with pytest.raises(APIError) as refused:
        fields.check_engine_supports(request, "small")
    assert (refused.value.status_code, refused.value.param, refused.value.code) == (400, name, "unsupported_parameter")


@pytest.mark.parametrize("name", _cases(COMPLETIONS, FORWARDED))
def test_a_forwarded_completions_field_reaches_http_tiers_untouched_and_our_engine_refuses_it(name: str) -> None:
    request = _decode({**BASE_COMPLETION, name: SOMETHING}, CompletionRequest)
    check_request(request)
    assert json.loads(to_body(request, model="upstream"))[name] == SOMETHING
    with pytest.raises(APIError, match=name):
        fields.check_engine_supports(request, "small")


@pytest.mark.parametrize("name", _cases(CHAT, REFUSED) + _cases(COMPLETIONS, REFUSED))
def test_a_refused_field_gets_a_400_naming_it(name: str) -> None:
    request = _decode({**BASE_CHAT, name: SOMETHING}, ChatCompletionRequest)
    with pytest.raises(APIError) as refused:
        check_request(request)
    assert (refused.value.status_code, refused.value.param, refused.value.code) == (400, name, "unsupported_parameter")


def test_neutral_values_of_forwarded_fields_ask_for_nothing() -> None:
    request = _decode({**BASE_CHAT, "store": False, "service_tier": "auto", "modalities": ["text"],
                       "reasoning_effort": "none", "verbosity": "medium"}, ChatCompletionRequest)
    fields.check_engine_supports(request, "small")
    for name, value in (("reasoning_effort", "low"), ("verbosity", "high")):
        with pytest.raises(APIError, match=name):
            fields.check_engine_supports(_decode({**BASE_CHAT, name: value}, ChatCompletionRequest), "small")


@pytest.mark.parametrize("name", _cases(CHAT, HONOURED))
def test_honoured_chat_fields_are_typed_not_passed_through_blindly(name: str) -> None:
    annotation = ChatCompletionRequest.__annotations__[name]
    assert "Any" not in str(annotation), f"{name} is honoured, so the wire schema must type it"


def test_unknown_fields_are_forwarded_to_http_tiers_and_refused_by_our_engine() -> None:
    body = {**BASE_CHAT, "length_penalty": 1.05, "chat_template_kwargs": {"enable_thinking": False}}
    request = _decode(body, ChatCompletionRequest)
    payload = json.loads(to_body(request, model="upstream"))
    assert payload["length_penalty"] == 1.05 and payload["chat_template_kwargs"] == {"enable_thinking": False}
    assert payload["model"] == "upstream"
    with pytest.raises(APIError) as refused:
        fields.check_engine_supports(request, "small")
    assert refused.value.param in {"length_penalty", "chat_template_kwargs"}


def test_a_request_without_unknown_fields_carries_none() -> None:
    assert fields.extra_fields(_decode(BASE_CHAT, ChatCompletionRequest)) == {}
    assert fields.extra_fields(msgspec.convert(BASE_CHAT, ChatCompletionRequest)) == {}


def test_capabilities_name_tools_and_the_response_format() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    plain = fields.capabilities(_decode(BASE_CHAT, ChatCompletionRequest))
    assert plain == fields.Capabilities(uses_tools=False, response_format=None)
    tools = fields.capabilities(_decode({**BASE_CHAT, "tools": [tool]}, ChatCompletionRequest))
    assert tools == fields.Capabilities(uses_tools=True, response_format=None)
    none = fields.capabilities(_decode({**BASE_CHAT, "tools": [tool], "tool_choice": "none"}, ChatCompletionRequest))
    assert not none.uses_tools
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    structured = fields.capabilities(_decode({**BASE_CHAT, "response_format": schema}, ChatCompletionRequest))
    assert structured.response_format == "json_schema"
    text = fields.capabilities(_decode({**BASE_CHAT, "response_format": {"type": "text"}}, ChatCompletionRequest))
    assert text.response_format is None
    both = fields.capabilities(_decode({**BASE_CHAT, "tools": [tool], "structured_outputs": {"regex": "a"}},
                                       ChatCompletionRequest))
    assert both == fields.Capabilities(uses_tools=True, response_format=fields.STRUCTURED)  # neither need lost
    completion = fields.capabilities(_decode({"model": "m", "prompt": "p", "structured_outputs": {"regex": "a"}},
                                             CompletionRequest))
    assert completion == fields.Capabilities(uses_tools=False, response_format=fields.STRUCTURED)
