"""The OpenAI layer over a real (tiny, random-weight) engine: parameter mapping, stop strings, `n`,
logprobs, usage with prefix-cache hits, and OpenAI-style errors."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import tokenizers

from engines.api.errors import APIError
from engines.api.prompts import completion_prompts, count_prompt_tokens
from engines.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    ResponseFormat,
)
from engines.api.rules import check_request, decode_request
from engines.llm_engine import LLMEngine
from engines.serving import OpenAIServing, backend_fingerprint, is_usage_chunk
from engines.tokenizer import Tokenizer
from tests.serving.conftest import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MODEL_NAME,
    eventually_running,
    idle_kv_blocks_used,
    wait_until_idle,
)

LONG_TEXT = (
    "The scheduler decides which sequences run in the next step and how many tokens each of them may take. "
    "Attention is computed over keys and values that are stored in blocks of a paged cache on the device. "
)


def chat(content: str, **fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(model=MODEL_NAME, messages=[ChatMessage(role="user", content=content)], **fields)


def completion(prompt: object, **fields: object) -> CompletionRequest:
    return CompletionRequest(model=MODEL_NAME, prompt=prompt, **fields)  # type: ignore[arg-type]


# -- mapping requests to engine calls --------------------------------------------------------------


def test_defaults_sample_at_temperature_one_up_to_the_remaining_context(serving: OpenAIServing) -> None:
    (call,) = serving.prepare_chat(chat("Hello"))
    prompt_tokens = serving.count_prompt_tokens(chat("Hello"))
    assert call.prompt_token_ids == serving.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert len(call.prompt_token_ids) == prompt_tokens
    assert call.params.temperature == 1.0
    assert call.params.top_p == 1.0
    assert call.params.top_k == 0
    assert call.params.max_tokens == MAX_MODEL_LEN - prompt_tokens
    assert call.params.logprobs is False


def test_request_fields_map_onto_sampling_params(serving: OpenAIServing) -> None:
    request = chat(
        "Hello", temperature=0.0, top_p=0.5, top_k=7, min_p=0.05, seed=11, stop=["x", "", "yz"], max_tokens=3,
        max_completion_tokens=9, logprobs=True, top_logprobs=4, repetition_penalty=1.2,
    )  # fmt: skip
    (call,) = serving.prepare_chat(request)
    assert call.params.greedy
    assert (call.params.top_p, call.params.top_k, call.params.min_p, call.params.seed) == (0.5, 7, 0.05, 11)
    assert call.params.repetition_penalty == 1.2 and call.params.penalised
    assert call.params.stop == ["x", "yz"]  # empty stop strings mean nothing
    assert call.params.max_tokens == 9  # max_completion_tokens supersedes max_tokens
    assert (call.params.logprobs, call.params.top_logprobs) == (True, 4)


def test_n_becomes_n_engine_requests_with_suffixed_ids_and_distinct_seeds(serving: OpenAIServing) -> None:
    calls = serving.prepare_chat(chat("Hello", n=3, seed=5))
    base = calls[0].request_id.rsplit("-", 1)[0]
    assert [c.request_id for c in calls] == [f"{base}-0", f"{base}-1", f"{base}-2"]
    assert [c.index for c in calls] == [0, 1, 2]
    assert [c.params.seed for c in calls] == [5, 6, 7]


def test_completion_prompt_forms_and_integer_logprobs(serving: OpenAIServing) -> None:
    ids = serving.tokenizer.encode("Hello world")
    assert [c.prompt_token_ids for c in serving.prepare_completion(completion("Hello world"))] == [ids]
    assert [c.prompt_token_ids for c in serving.prepare_completion(completion(ids))] == [ids]
    batch = serving.prepare_completion(completion(["Hello world", "Paris"], n=2))
    assert [(c.index, c.prompt_index) for c in batch] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    (call,) = serving.prepare_completion(completion("Hello", logprobs=3))
    assert (call.params.logprobs, call.params.top_logprobs, call.params.max_tokens) == (True, 3, 16)


def test_a_suffix_asks_for_the_gap_in_the_models_fill_in_the_middle_layout(serving: OpenAIServing) -> None:
    prefix, suffix, middle = serving.tokenizer.fim_token_ids
    before, after = serving.tokenizer.encode("def add(a, b):"), serving.tokenizer.encode("\n    return total")
    calls = serving.prepare_completion(completion(["def add(a, b):", before], suffix="\n    return total"))
    assert [c.prompt_token_ids for c in calls] == [[prefix, *before, suffix, *after, middle]] * 2
    request = completion("def add(a, b):", suffix="\n    return total")
    assert serving.count_prompt_tokens(request) == len(before) + len(after) + 3  # what the engine bills
    # The stop sequences an editor's fill-in-the-middle template sends (Continue's for Qwen2.5-Coder): more than 4.
    editor_stops = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                    "<|repo_name|>", "<|file_sep|>", "<|im_start|>", "<|im_end|>"]
    check_request(request := completion("def add(a, b):", suffix="\n    return total", stop=editor_stops))
    assert serving.prepare_completion(request)[0].params.stop == editor_stops
    # An empty suffix asks for nothing: a plain completion.
    assert serving.prepare_completion(completion("def add(a, b):", suffix=""))[0].prompt_token_ids == before


def test_a_model_without_fill_in_the_middle_tokens_refuses_a_suffix_and_still_counts_it() -> None:
    vocab = {"<unk>": 0, "def": 1, "add": 2, "return": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    plain = Tokenizer(backend, None, bos_token_id=None, eos_token_id=None)
    request = completion(["def add", "def"], suffix="return")
    with pytest.raises(APIError) as raised:
        completion_prompts(plain, request)
    assert (raised.value.status_code, raised.value.detail.param) == (400, "suffix")
    assert raised.value.detail.code == "unsupported_parameter"
    # An HTTP tier with this tokenizer fills in for itself: the gateway counts the prompts and the suffix.
    assert count_prompt_tokens(plain, request) == 2 + 1 + 2 * 1


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (chat("Hi", temperature=2.5), "temperature"),
        (chat("Hi", top_p=-0.1), "top_p"),
        (chat("Hi", top_p=1.5), "top_p"),
        (chat("Hi", min_p=1.5), "min_p"),
        (chat("Hi", repetition_penalty=0.0), "repetition_penalty"),
        (chat("Hi", stop_token_ids=[-1]), "stop_token_ids"),
        (chat("Hi", min_tokens=-1), "min_tokens"),
        (chat("Hi", max_tokens=4, min_tokens=5), "min_tokens"),
        (chat("Hi", min_tokens=2, response_format=ResponseFormat(type="json_object")), "min_tokens"),
        (chat("Hi", stop_token_ids=[10**9]), "stop_token_ids"),
        (chat("Hi", n=0), "n"),
        (chat("Hi", seed=2**64), "seed"),
        (completion("Hi", seed=-(2**63) - 1), "seed"),
        (chat("Hi", max_tokens=0), "max_tokens"),
        (chat("Hi", max_completion_tokens=-1), "max_completion_tokens"),
        (chat("Hi", stop=[str(i) for i in range(65)]), "stop"),
        (chat("Hi", top_logprobs=2), "top_logprobs"),
        (chat("Hi", logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat("Hi", presence_penalty=2.5), "presence_penalty"),
        (chat("Hi", frequency_penalty=-3), "frequency_penalty"),
        (chat("Hi", logit_bias={"7": 101.0}), "logit_bias.7"),
        (chat("Hi", logit_bias={"seven": 1.0}), "logit_bias"),
        (chat("Hi", logit_bias={str(i): 1.0 for i in range(301)}), "logit_bias"),
        (chat("Hi", logit_bias={"1000000": 1.0}), "logit_bias"),
        (completion("Hi", presence_penalty=-2.01), "presence_penalty"),
        (ChatCompletionRequest(model=MODEL_NAME, messages=[]), "messages"),
        (
            ChatCompletionRequest(model=MODEL_NAME, messages=[ChatMessage(role="robot", content="x")]),
            "messages[0].role",
        ),
        (
            ChatCompletionRequest(
                model=MODEL_NAME, messages=[ChatMessage(role="user", content=[ContentPart(type="image_url")])]
            ),
            "messages[0].content[0].type",
        ),
        (completion("Hi", logprobs=6), "logprobs"),
        (completion("Hi", suffix="!", echo=True), "suffix"),
        (completion("Hi", max_tokens=0), "max_tokens"),  # nothing to generate and nothing to echo
        (completion([1, 2, 10**6]), "prompt"),
        (completion(""), "prompt"),
    ],
)
def test_invalid_parameters_raise_an_openai_invalid_request_error(
    serving: OpenAIServing, request_: ChatCompletionRequest | CompletionRequest, param: str
) -> None:
    with pytest.raises(APIError) as raised:
        check_request(request_)  # the rules of the API, once at the edge (engine server or gateway)
        if isinstance(request_, ChatCompletionRequest):  # then the rules of this model
            serving.prepare_chat(request_)
        else:
            serving.prepare_completion(request_)
    assert raised.value.status_code == 400
    assert raised.value.detail.type == "invalid_request_error"
    assert raised.value.detail.param == param


def test_a_request_beyond_the_context_length_is_refused_with_context_length_exceeded(serving: OpenAIServing) -> None:
    prompt_tokens = serving.count_prompt_tokens(chat("Hello"))
    with pytest.raises(APIError) as raised:
        serving.prepare_chat(chat("Hello", max_tokens=MAX_MODEL_LEN - prompt_tokens + 1))
    assert raised.value.detail.code == "context_length_exceeded"
    assert raised.value.detail.param == "max_tokens"
    serving.prepare_chat(chat("Hello", max_tokens=MAX_MODEL_LEN - prompt_tokens))  # exactly fits


def test_streams_validate_when_called_before_anything_is_sent(serving: OpenAIServing) -> None:
    with pytest.raises(APIError):
        serving.chat_stream(chat("Hi", max_tokens=MAX_MODEL_LEN))


def test_decoding_a_body_names_the_offending_field() -> None:
    with pytest.raises(APIError) as malformed:
        decode_request(b'{"model": "m", "messages": [', ChatCompletionRequest)
    assert (malformed.value.status_code, malformed.value.detail.code) == (400, "invalid_json")
    with pytest.raises(APIError) as mistyped:
        decode_request(b'{"model": "m", "messages": [], "max_tokens": "ten"}', ChatCompletionRequest)
    assert mistyped.value.detail.param == "max_tokens"
    with pytest.raises(APIError) as missing:
        decode_request(b'{"model": "m"}', ChatCompletionRequest)
    assert "messages" in missing.value.detail.message


# -- generation ----------------------------------------------------------------------------------


async def test_greedy_chat_is_deterministic_and_reports_usage(serving: OpenAIServing) -> None:
    request = chat("What is the capital of France?", temperature=0, max_tokens=12)
    first = await serving.chat(request)
    second = await serving.chat(request)
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.prompt_tokens == serving.count_prompt_tokens(request)
    assert 1 <= first.usage.completion_tokens <= 12
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    assert first.model == MODEL_NAME and first.id.startswith("chatcmpl-")


async def test_every_answer_names_its_backend_in_system_fingerprint(serving: OpenAIServing, async_engine) -> None:
    """OpenAI's field for telling, beside `seed`, when the backend changed: here the model file and the precision
    and kernels its steps run with."""
    answers = [await serving.chat(chat("Hi", max_tokens=2)), await serving.complete(completion("Hi", max_tokens=2)),
               *[chunk async for chunk in serving.chat_stream(chat("Hi", max_tokens=2))],
               *[chunk async for chunk in serving.complete_stream(completion("Hi", max_tokens=2))]]
    assert {answer.system_fingerprint for answer in answers} == {serving.system_fingerprint}
    assert serving.system_fingerprint.startswith("fp_")
    config = async_engine.engine.config
    int8 = LLMEngine(replace(config, quantization="int8"))
    assert backend_fingerprint(int8) != serving.system_fingerprint
    assert backend_fingerprint(LLMEngine(config)) == serving.system_fingerprint


async def test_vllms_stop_token_ids_end_the_answer_and_ignore_eos_runs_to_the_limit(serving: OpenAIServing) -> None:
    """What vLLM clients send: benchmark tools set `ignore_eos` to get answers of a fixed length."""
    eos = serving.engine.tokenizer.eos_token_ids[0]
    forced = {str(eos): 100.0}  # the random model would otherwise rarely pick it
    ended = await serving.complete(completion("Hi", max_tokens=8, logit_bias=forced))
    assert (ended.choices[0].finish_reason, ended.usage.completion_tokens) == ("stop", 1)
    ran_on = await serving.complete(completion("Hi", max_tokens=8, logit_bias=forced, ignore_eos=True))
    assert (ran_on.choices[0].finish_reason, ran_on.usage.completion_tokens) == ("length", 8)
    token = 7
    stopped = await serving.complete(completion("Hi", max_tokens=8, logit_bias={str(token): 100.0},
                                                stop_token_ids=[token]))  # fmt: skip
    choice = stopped.choices[0]
    assert (choice.finish_reason, stopped.usage.completion_tokens, choice.text) == ("stop", 1, "")


async def test_a_repetition_penalty_keeps_a_greedy_answer_off_the_tokens_it_has_seen(serving: OpenAIServing) -> None:
    """The random model repeats itself when greedy; vLLM's penalty counts the prompt's tokens as seen too."""
    prompt = [5, 6, 7, 8]
    seen = {serving.tokenizer.token_text(token) for token in prompt}

    async def tokens(**fields: object) -> list[str]:
        answer = await serving.complete(completion(prompt, max_tokens=12, temperature=0, logprobs=0, **fields))
        return answer.choices[0].logprobs.tokens

    plain, penalised = await tokens(), await tokens(repetition_penalty=10.0)
    assert len(set(plain)) < len(plain) or set(plain) & seen  # what the penalty is there to prevent
    # Tokens are told apart by their text here, and byte pieces of characters all read "\ufffd": those aside.
    whole = [token for token in penalised if token != "\ufffd"]
    assert len(set(whole)) == len(whole) and not set(penalised) & seen


async def test_vllms_min_tokens_holds_the_answer_open_past_eos_and_stop_tokens(serving: OpenAIServing) -> None:
    eos = serving.engine.tokenizer.eos_token_ids[0]
    token = 7
    for end, extra in ((eos, {}), (token, {"stop_token_ids": [token]})):
        forced = {str(end): 100.0}  # without min_tokens, the answer would end at its first token
        held = await serving.complete(completion("Hi", max_tokens=8, logit_bias=forced, min_tokens=3, **extra))
        # Three other tokens, then the end, counted as without min_tokens.
        assert (held.choices[0].finish_reason, held.usage.completion_tokens) == ("stop", 4)
    forced = {str(eos): 100.0}
    running = await serving.complete(completion("Hi", max_tokens=5, logit_bias=forced, min_tokens=5))
    assert (running.choices[0].finish_reason, running.usage.completion_tokens) == ("length", 5)


async def test_generation_stops_before_the_first_stop_string(serving: OpenAIServing) -> None:
    base = chat("Once upon a time", temperature=0, max_tokens=40)
    text = (await serving.chat(base)).choices[0].message.content or ""
    assert len(text) > 8, f"the tiny model produced too little text to cut: {text!r}"
    stop = text[5:8]
    expected = text[: text.index(stop)]
    stopped = await serving.chat(chat("Once upon a time", temperature=0, max_tokens=40, stop=stop))
    assert stopped.choices[0].message.content == expected
    assert stopped.choices[0].finish_reason == "stop"


async def test_n_choices_share_one_prompt_in_usage(serving: OpenAIServing) -> None:
    request = chat("Tell me a story", n=3, seed=1, max_tokens=6)
    response = await serving.chat(request)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert response.usage.prompt_tokens == serving.count_prompt_tokens(request)
    produced = response.usage.completion_tokens
    assert 3 <= produced <= 18


async def test_chat_logprobs_have_one_entry_per_token_with_sorted_alternatives(serving: OpenAIServing) -> None:
    response = await serving.chat(chat("Hello", temperature=0, max_tokens=5, logprobs=True, top_logprobs=3))
    choice = response.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == response.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the most likely token
        assert entry.bytes is not None
    assert "".join(e.token for e in entries).startswith(choice.message.content or "")


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_with_logprobs_scores_the_prompt_as_lm_evaluation_harness_reads_it(serving: OpenAIServing,
                                                                                     stream: bool) -> None:
    """lm-eval's loglikelihood requests: token ids, echo, logprobs 1, one new token; it sums the prompt's logprobs
    after its context and checks each against the top one."""
    prompt = serving.tokenizer.encode("The weather is nice today")
    request = completion(prompt, echo=True, logprobs=1, max_tokens=1, temperature=0, stream=stream)
    if stream:
        chunks = [chunk async for chunk in serving.complete_stream(request)]
        (choice,) = chunks[0].choices
    else:
        (choice,) = (await serving.complete(request)).choices
    logprobs = choice.logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert len(logprobs.token_logprobs) == len(prompt) + 1  # the prompt's tokens, then the new one
    assert logprobs.tokens[:len(prompt)] == [serving.tokenizer.token_text(t) for t in prompt]
    for value, top in zip(logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True):
        assert value <= 0 and len(top) == 1 and value <= max(top.values()) + 1e-6
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    assert choice.text.startswith(serving.tokenizer.decode(prompt))


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(serving: OpenAIServing,
                                                                              stream: bool) -> None:
    """OpenAI's legacy scoring call (and vLLM's): the prompt back with its logprobs, no answer, no output tokens."""
    prompt = "The weather is nice today"
    scored = await serving.complete(completion(prompt, echo=True, logprobs=2, max_tokens=1, temperature=0))
    request = completion(prompt, echo=True, logprobs=2, max_tokens=0, temperature=0, stream=stream)
    check_request(request)  # the gateway's rules let it through
    if stream:
        chunks = [chunk async for chunk in serving.complete_stream(request)]
        (choice,), usage = chunks[0].choices, chunks[-1].usage
        assert len(chunks) == 2 and is_usage_chunk(chunks[-1])
    else:
        response = await serving.complete(request)
        (choice,), usage = response.choices, response.usage
    num_prompt_tokens = len(serving.tokenizer.encode(prompt))
    assert (choice.text, choice.finish_reason) == (prompt, "length")
    assert choice.logprobs.token_logprobs == scored.choices[0].logprobs.token_logprobs[:num_prompt_tokens]
    assert len(choice.logprobs.tokens) == num_prompt_tokens
    assert (usage.prompt_tokens, usage.completion_tokens) == (num_prompt_tokens, 0)


async def test_completion_logprobs_follow_the_legacy_shape(serving: OpenAIServing) -> None:
    response = await serving.complete(completion("The weather is", temperature=0, max_tokens=4, logprobs=2))
    logprobs = response.choices[0].logprobs
    assert logprobs is not None
    n = response.usage.completion_tokens if response.usage else 0
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == n
    assert all(top is not None and len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset)


async def test_a_repeated_long_prompt_reports_cached_prompt_tokens(serving: OpenAIServing) -> None:
    request = chat("Remember this. " + LONG_TEXT * 3, temperature=0, max_tokens=2)
    first = await serving.chat(request)
    second = await serving.chat(request)
    assert first.usage.cached_tokens == 0
    assert first.usage.prompt_tokens > 4 * BLOCK_SIZE
    assert 0 < second.usage.cached_tokens < second.usage.prompt_tokens
    assert second.usage.cached_tokens % BLOCK_SIZE == 0  # whole blocks are shared


async def test_chat_stream_announces_the_role_then_deltas_then_finish_then_usage(serving: OpenAIServing) -> None:
    # The usage-only chunk comes even though the request did not ask for it: in-process callers charge from it.
    request = chat("Hello there", temperature=0, max_tokens=10)
    expected = await serving.chat(request)
    chunks = [chunk async for chunk in serving.chat_stream(request)]
    content_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in content_chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == expected.choices[0].message.content
    assert [c.choices[0].finish_reason for c in content_chunks][-1] == expected.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    assert is_usage_chunk(usage_chunk) and usage_chunk.usage is not None
    assert usage_chunk.usage.prompt_tokens == expected.usage.prompt_tokens
    assert usage_chunk.usage.completion_tokens == expected.usage.completion_tokens
    assert usage_chunk.usage.cached_tokens > 0  # the same prompt, just served
    assert len({c.id for c in chunks}) == 1


async def test_completion_stream_with_echo_starts_with_the_prompt(serving: OpenAIServing) -> None:
    request = completion("Numbers like", temperature=0, max_tokens=6, echo=True, stream=True)
    chunks = [chunk async for chunk in serving.complete_stream(request)]
    text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    assert text.startswith("Numbers like")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


async def test_leaving_a_stream_early_aborts_its_engine_requests(serving: OpenAIServing) -> None:
    baseline = await idle_kv_blocks_used(serving.engine)
    before = serving.engine.stats()
    probe = chat("Write a long story about a robot", temperature=0, max_tokens=300, n=2)
    stream = serving.chat_stream(probe)
    await anext(stream)
    await eventually_running(serving.engine, 2)
    await stream.aclose()
    await wait_until_idle(serving.engine, baseline)
    # Cut short, not run to the end: both choices aborted with far fewer than 2 × 300 tokens made.
    for _ in range(500):  # statistics are as of the latest step
        if serving.engine.stats().num_aborted_total - before.num_aborted_total >= 2:
            break
        await asyncio.sleep(0.01)
    after = serving.engine.stats()
    assert after.num_aborted_total - before.num_aborted_total == 2
    assert after.num_generated_tokens_total - before.num_generated_tokens_total < 300

