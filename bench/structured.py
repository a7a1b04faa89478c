"""Structured outputs and tool calls on the small tier: what constrained decoding costs and whether it holds.

1. Grammar libraries, per-token mask time on the small model's vocabulary at batch 1 and 16:
   llguidance (ours) against xgrammar, walking the same JSON text token by token.
2. Decode tokens/s with and without a JSON schema at batch 1 and 16 (the schema forces a long
   array, so constrained and free rows decode the same number of tokens).
3. Schema-valid rate: replies to `response_format: json_schema` requests that parse and validate.
4. Tool-call parse rate on the fixed 50 prompts of bench/data/tool_prompts.jsonl: with
   `tool_choice: "auto"` (the model's own calls: `<tool_call>` blocks, or a reply that is only JSON calls)
   and with `"required"` (forced).
5. Tools beside a response format (`"auto"` with a `json_schema`, as the OpenAI Agents SDK sends an agent
   with tools and an output type): over those 50 prompts and 10 that need no tool, replies that are valid
   calls or a valid answer, which of the two the model chose, and the expected function.

    sluice bench structured [--max-tokens 64] [--batches 1 16] [--repeats 5]
    sluice bench structured --model large --tools-only   # parts 4 and 5 alone, for any model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import torch

from bench.common import cpu_model, print_table, write_results
from engines import tool_calls
from engines.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    JSONSchemaFormat,
    ResponseFormat,
    Tool,
    ToolCall,
)
from engines.config import EngineConfig
from engines.llm_engine import AsyncLLMEngine, LLMEngine
from engines.registry import resolve_model
from engines.sampling_params import GrammarSpec, SamplingParams
from engines.serving import OpenAIServing
from engines.structured import Grammars, allocate_bitmask, apply_bitmask

PROMPTS = Path(__file__).resolve().parent / "data" / "tool_prompts.jsonl"
LONG_ARRAY = {  # forces at least 40 items: a constrained row cannot finish before the free one
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 40}},
    "required": ["items"],
    "additionalProperties": False,
}
# Compact, as both grammars are built (no free whitespace).
MASK_TEXT = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"], "ok": True},
                       separators=(",", ":"))
MASK_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
VALIDITY_CASES: list[tuple[str, dict[str, Any]]] = [
    ("Give the capital of France and its population in millions.",
     {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                       "population_millions": {"type": "number"}},
      "required": ["city", "population_millions"], "additionalProperties": False}),
    ("List three primary colours.",
     {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                   "maxItems": 5}},
      "required": ["colours"], "additionalProperties": False}),
    ("Is Python dynamically typed? Answer with a confidence from 0 to 10.",
     {"type": "object", "properties": {"answer": {"type": "boolean"},
                                       "confidence": {"type": "integer", "minimum": 0, "maximum": 10}},
      "required": ["answer", "confidence"], "additionalProperties": False}),
    ("Classify the sentiment of: 'I love this library'.",
     {"type": "object", "properties": {"sentiment": {"enum": ["positive", "neutral", "negative"]}},
      "required": ["sentiment"], "additionalProperties": False}),
    ("Describe a user named Ann, aged 31, with an address in Lyon.",
     {"type": "object", "properties": {
         "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
         "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                     "required": ["city"], "additionalProperties": False}},
      "required": ["name", "age", "address"], "additionalProperties": False}),
]
ANSWER_FORMAT = ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(name="answer", strict=True, schema={
    "type": "object", "properties": {"answer": {"type": "string", "maxLength": 160}}, "required": ["answer"],
    "additionalProperties": False}))
NO_TOOL_PROMPTS = [  # none of TOOLS helps with these
    "Say hello to Ann.", "Write a one-line greeting for a new colleague.", "What is the opposite of 'ancient'?",
    "Name a primary colour.", "Translate 'thank you' into French.", "Suggest a name for a grey cat.",
    "Is a tomato a fruit or a vegetable?", "Give a synonym of 'happy'.", "What sound does a cow make?",
    "Finish the sentence: the early bird ...",
]
TOOLS = [
    Tool(type="function", function=FunctionDefinition(
        name="get_weather", description="Current weather in a city",
        parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})),
    Tool(type="function", function=FunctionDefinition(
        name="get_time", description="Current local time in a city",
        parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})),
    Tool(type="function", function=FunctionDefinition(
        name="convert_currency", description="Convert an amount between currencies",
        parameters={"type": "object", "properties": {"amount": {"type": "number"}, "from": {"type": "string"},
                                                     "to": {"type": "string"}},
                    "required": ["amount", "from", "to"]})),
    Tool(type="function", function=FunctionDefinition(
        name="web_search", description="Search the web",
        parameters={"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]})),
    Tool(type="function", function=FunctionDefinition(
        name="calculate", description="Evaluate an arithmetic expression",
        parameters={"type": "object", "properties": {"expression": {"type": "string"}},
                    "required": ["expression"]})),
]


# -- 1. mask time per library ------------------------------------------------------------------------


def mask_times(llm: LLMEngine, batches: Sequence[int]) -> dict[str, dict[str, float]]:
    """Milliseconds per decode step to fill the bitmask of `batch` rows, per library."""
    import xgrammar as xgr

    tokenizer, vocab = llm.tokenizer, llm.model_config.vocab_size
    token_ids = tokenizer.encode(MASK_TEXT)
    ours = Grammars(tokenizer, vocab, sorted(llm.scheduler.eos_token_ids))
    spec = GrammarSpec("json_schema", json.dumps(MASK_SCHEMA))
    entries = [b"" if tokenizer.is_special(i) else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    eos = sorted(llm.scheduler.eos_token_ids)
    info = xgr.TokenizerInfo(entries, xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=eos)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(MASK_SCHEMA), any_whitespace=False,
                                                                 separators=(",", ":"))
    results: dict[str, dict[str, float]] = {}
    for batch in [1, *batches]:  # the first pass warms both libraries' caches and is not reported
        bitmask = allocate_bitmask(batch, vocab)
        states = [ours.matcher(spec) for _ in range(batch)]
        started = time.perf_counter()
        for token in token_ids:
            for row, state in enumerate(states):
                state.fill(bitmask, row)
            assert all(state.accept(token) for state in states), "llguidance refused the text"
        llguidance_ms = (time.perf_counter() - started) / len(token_ids) * 1e3
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
        xgr_mask = xgr.allocate_token_bitmask(batch, vocab)
        started = time.perf_counter()
        for token in token_ids:
            for row, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(xgr_mask, row)
            assert all(matcher.accept_token(token) for matcher in matchers), "xgrammar refused the text"
        xgrammar_ms = (time.perf_counter() - started) / len(token_ids) * 1e3
        logits = torch.randn(batch, vocab)
        started = time.perf_counter()
        for _ in range(10):
            apply_bitmask(logits.clone(), bitmask)
        apply_ms = (time.perf_counter() - started) / 10 * 1e3
        results[f"batch_{batch}"] = {"llguidance_fill_ms_per_step": llguidance_ms,
                                     "xgrammar_fill_ms_per_step": xgrammar_ms,
                                     "mask_apply_all_rows_ms": apply_ms}
    return results


# -- 2. decode throughput ----------------------------------------------------------------------------


def decode_tokens_per_s(llm: LLMEngine, prompt: list[int], batch: int, max_tokens: int,
                        grammar: GrammarSpec | None) -> float:
    """Decode tokens/s of `batch` identical-length requests, timed from the step after the last prefill."""
    for i in range(batch):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=grammar is None, grammar=grammar)
        llm.add_request(f"d{batch}-{i}-{grammar is not None}", prompt, params)
    produced, started, counted = 0, None, 0
    while llm.has_unfinished_requests():
        outputs = llm.step()
        if started is None:
            if outputs and len(llm.scheduler.waiting) == 0 and all(
                    s.num_output_tokens >= 1 for s in llm.scheduler.running):
                started = time.perf_counter()
            continue
        produced += sum(len(o.new_token_ids) for o in outputs)
        counted += 1
    assert started is not None and counted
    return produced / (time.perf_counter() - started)


# -- 3 and 4: through the OpenAI layer -----------------------------------------------------------------


def _user(text: str) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=text)]


async def validity(serving: OpenAIServing, max_tokens: int) -> dict[str, Any]:
    async def one(prompt: str, schema: dict[str, Any]) -> tuple[bool, bool]:
        request = ChatCompletionRequest(
            model="bench", messages=_user(prompt + " Reply in JSON."), temperature=0, max_tokens=max_tokens,
            response_format=ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(
                name="r", schema=schema, strict=True)))
        choice = (await serving.chat(request)).choices[0]
        try:
            jsonschema.validate(json.loads(choice.message.content or ""), schema)
            return True, choice.finish_reason == "stop"
        except (ValueError, jsonschema.ValidationError):
            return False, choice.finish_reason == "stop"

    results = await asyncio.gather(*(one(p, s) for p, s in VALIDITY_CASES))
    finished = [valid for valid, stopped in results if stopped]
    return {"requests": len(results), "finished_by_grammar": len(finished),
            "valid_of_finished": sum(finished), "schema_valid_rate": sum(finished) / max(1, len(finished))}


@dataclass(frozen=True)
class ToolOutcome:
    """One tool prompt's answer: a call attempted in any form, read as calls, the expected function called,
    and that with arguments valid against its schema."""

    attempted: bool
    parsed: bool
    expected_function: bool
    schema_valid_arguments: bool


async def tool_rates(serving: OpenAIServing, tool_choice: str, max_tokens: int) -> dict[str, Any]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]

    schemas = {tool.function.name: tool.function.parameters for tool in TOOLS}

    def valid_arguments(call: ToolCall) -> bool:
        try:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        except (ValueError, KeyError, jsonschema.ValidationError):
            return False
        return True

    async def one(row: dict[str, str]) -> ToolOutcome:
        request = ChatCompletionRequest(model="bench", messages=_user(row["prompt"]), tools=TOOLS,
                                        tool_choice=tool_choice, temperature=0, max_tokens=max_tokens)
        choice = (await serving.chat(request)).choices[0]
        calls = choice.message.tool_calls or []
        text = (choice.message.content or "").lstrip()
        # A call in any form: read as calls, or a `<tool_call>` block or JSON reply that was not one.
        attempted = (bool(calls) or "<tool_call>" in text or text[:1] in tool_calls.WHOLE_REPLY_OPENERS
                     or tool_choice == "required")
        parsed = bool(calls) and all(isinstance(json.loads(c.function.arguments), dict) for c in calls)
        right = parsed and calls[0].function.name == row["expect"]
        return ToolOutcome(attempted, parsed, right, right and all(valid_arguments(call) for call in calls))

    outcomes = await asyncio.gather(*(one(row) for row in rows))
    attempted = sum(o.attempted for o in outcomes)
    parsed = sum(o.parsed for o in outcomes)
    return {"prompts": len(rows), "attempted_tool_call": attempted, "parsed_tool_call": parsed,
            "tool_call_parse_rate": parsed / max(1, attempted),
            "expected_function": sum(o.expected_function for o in outcomes),
            "expected_function_with_schema_valid_arguments": sum(o.schema_valid_arguments for o in outcomes)}


async def format_rates(serving: OpenAIServing, max_tokens: int) -> dict[str, Any]:
    """Part 5: `tool_choice: "auto"` beside ANSWER_FORMAT over the tool prompts and NO_TOOL_PROMPTS."""
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    rows += [{"prompt": prompt, "expect": None} for prompt in NO_TOOL_PROMPTS]
    schemas = {tool.function.name: tool.function.parameters for tool in TOOLS}
    answer_schema = ANSWER_FORMAT.json_schema.schema  # type: ignore[union-attr]

    def valid(choice: Any) -> bool:
        try:
            for call in choice.message.tool_calls or []:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            if not choice.message.tool_calls:
                jsonschema.validate(json.loads(choice.message.content or ""), answer_schema)
        except (ValueError, KeyError, jsonschema.ValidationError):
            return False
        return True

    async def one(row: dict[str, Any]) -> tuple[bool, bool, bool]:
        request = ChatCompletionRequest(model="bench", messages=_user(row["prompt"]), tools=TOOLS, temperature=0,
                                        response_format=ANSWER_FORMAT, max_tokens=max_tokens)
        choice = (await serving.chat(request)).choices[0]
        calls = choice.message.tool_calls or []
        return valid(choice), bool(calls), bool(calls) and calls[0].function.name == row["expect"]

    outcomes = await asyncio.gather(*(one(row) for row in rows))
    tool_rows, no_tool_rows = outcomes[:-len(NO_TOOL_PROMPTS)], outcomes[-len(NO_TOOL_PROMPTS):]
    return {"prompts": len(rows), "max_tokens": max_tokens,
            "valid_calls_or_valid_answer": sum(v for v, _, _ in outcomes),
            "tool_prompts": len(tool_rows), "tool_prompts_called": sum(c for _, c, _ in tool_rows),
            "tool_prompts_expected_function": sum(e for _, _, e in tool_rows),
            "no_tool_prompts": len(no_tool_rows), "no_tool_prompts_answered": sum(not c for _, c, _ in no_tool_rows)}


def through_serving(llm: LLMEngine, tool_max_tokens: int, with_validity: bool
                    ) -> tuple[dict[str, Any] | None, dict[str, Any], dict[str, Any], dict[str, Any]]:  # fmt: skip
    """Parts 3, 4 and 5 through the OpenAI layer (schema validity only `with_validity`); prints their table."""
    serving = OpenAIServing(AsyncLLMEngine(llm), "bench")

    async def run() -> tuple[dict[str, Any] | None, dict[str, Any], dict[str, Any], dict[str, Any]]:
        try:
            return (await validity(serving, 96) if with_validity else None,
                    await tool_rates(serving, "auto", tool_max_tokens),
                    await tool_rates(serving, "required", tool_max_tokens),
                    await format_rates(serving, 2 * tool_max_tokens))
        finally:
            await serving.engine.shutdown()

    valid, auto, required, beside = asyncio.run(run())
    rows = [] if valid is None else [["schema-valid (of finished)",
                                      f"{valid['valid_of_finished']}/{valid['finished_by_grammar']}",
                                      valid["schema_valid_rate"]]]
    for name, rates in (("auto", auto), ("required", required)):
        rows.append([f"tool calls parsed, {name}", f"{rates['parsed_tool_call']}/{rates['attempted_tool_call']}",
                     rates["tool_call_parse_rate"]])
    for name, rates in (("auto", auto), ("required", required)):
        rows.append([f"expected function, {name}", f"{rates['expected_function']}/{rates['prompts']}",
                     rates["expected_function"] / rates["prompts"]])
    for name, rates in (("auto", auto), ("required", required)):
        valid_calls = rates["expected_function_with_schema_valid_arguments"]
        rows.append([f"... and arguments valid against its schema, {name}", f"{valid_calls}/{rates['prompts']}",
                     valid_calls / rates["prompts"]])
    for label, count, total in (
            ("tools beside a format: valid calls or valid answer", "valid_calls_or_valid_answer", "prompts"),
            ("... tool prompts answered with calls", "tool_prompts_called", "tool_prompts"),
            ("... tool prompts calling the expected function", "tool_prompts_expected_function", "tool_prompts"),
            ("... no-tool prompts answered in the format", "no_tool_prompts_answered", "no_tool_prompts")):
        rows.append([label, f"{beside[count]}/{beside[total]}", beside[count] / beside[total]])
    print_table("Schema validity and tool calls", ["measure", "count", "rate"], rows)
    return valid, auto, required, beside


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sluice bench structured", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="demo model name or GGUF path (default: small)")
    parser.add_argument("--max-tokens", type=int, default=64, help="decode tokens per request in part 2")
    parser.add_argument("--tool-max-tokens", type=int, default=48, help="reply tokens per tool prompt")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=5, help="free/constrained run pairs per batch (median)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tools-only", action="store_true",
                        help="only parts 4 and 5, tool calls (writes bench/results/structured_tools_<model>.json)")
    args = parser.parse_args(argv)

    config = EngineConfig(model=str(resolve_model(args.model)), dtype="float32", quantization="auto",
                          kv_cache_bytes=256 << 20, max_num_seqs=max(16, *args.batches),
                          max_num_batched_tokens=2048, max_model_len=4096, num_threads=args.threads)
    llm = LLMEngine(config)
    if args.tools_only:
        _, auto, required, beside = through_serving(llm, args.tool_max_tokens, with_validity=False)
        write_results(f"structured_tools_{Path(args.model).stem}", {
            "model": args.model, "cpu_model": cpu_model(), "precision": llm.precision(),
            "tool_max_tokens": args.tool_max_tokens, "tool_calls_auto": auto, "tool_calls_required": required,
            "tools_beside_response_format": beside})
        return
    masks = mask_times(llm, args.batches)
    print_table("Grammar mask per decode step (ms)", ["batch", "llguidance fill", "xgrammar fill", "apply (numpy)"],
                [[b, *masks[f"batch_{b}"].values()] for b in args.batches])

    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List forty fruits as a JSON object with an `items` array."}])
    schema = GrammarSpec("json_schema", json.dumps(LONG_ARRAY))
    decode: dict[str, dict[str, float]] = {}
    for batch in args.batches:
        # Alternate free and constrained runs and keep each one's median: one pair of short runs on a
        # 2-core machine differs by more than the effect measured.
        runs = [(decode_tokens_per_s(llm, prompt, batch, args.max_tokens, None),
                 decode_tokens_per_s(llm, prompt, batch, args.max_tokens, schema)) for _ in range(args.repeats)]
        free = statistics.median(f for f, _ in runs)
        constrained = statistics.median(c for _, c in runs)
        decode[f"batch_{batch}"] = {"free_tokens_per_s": free, "json_schema_tokens_per_s": constrained,
                                    "runs_free_tokens_per_s": [f for f, _ in runs],
                                    "runs_json_schema_tokens_per_s": [c for _, c in runs],
                                    "ratio_schema_to_free": constrained / free,
                                    "throughput_cost_pct": (1 - constrained / free) * 100}
    print_table("Decode tokens/s", ["batch", "free", "json_schema", "cost %"],
                [[b, d["free_tokens_per_s"], d["json_schema_tokens_per_s"], d["throughput_cost_pct"]]
                 for b, d in ((b, decode[f"batch_{b}"]) for b in args.batches)])

    valid, auto, required, beside = through_serving(llm, args.tool_max_tokens, with_validity=True)
    write_results("structured", {
        "model": args.model, "cpu_model": cpu_model(), "precision": llm.precision(),
        "max_tokens_decode": args.max_tokens,
        "grammar_mask_ms": masks, "decode": decode, "schema_validity": valid,
        "tool_calls_auto": auto, "tool_calls_required": required, "tools_beside_response_format": beside,
        "load_average_1min_at_end": os.getloadavg()[0],
    })


if __name__ == "__main__":
    main()
