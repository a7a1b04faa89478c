"""Constrained decoding on a random-weights model: whatever the model would say, the output parses and
validates against the schema. The model knows no JSON at all, so only the grammar can make this hold.

The documented subset of JSON Schema (README, "Structured outputs"): objects with `properties`,
`required` and `additionalProperties: false`; strings (`maxLength`), integers and numbers
(`minimum`/`maximum`), booleans, string `enum`s, arrays (`items`, `maxItems`), nested. The bounds
keep every output shorter than the tiny model's context, so each generation reaches its end.
"""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.llm_engine import LLMEngine
from engines.sampling_params import GrammarSpec, SamplingParams
from engines.structured import GrammarError, Grammars, allocate_bitmask, allows
from tests.engine.conftest import TinyModel, generated_ids, make_engine, run_to_completion

PROMPT = [5, 17, 42, 99, 3]
NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)

leaves = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 6)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-1000, 1000), st.integers(0, 5000)),
    st.builds(lambda lo, span: {"type": "number", "minimum": lo, "maximum": lo + span},
              st.integers(-100, 100), st.integers(1, 100)),
    st.just({"type": "boolean"}),
    st.builds(lambda values: {"type": "string", "enum": values},
              st.lists(st.text(alphabet="abcxyz ", min_size=1, max_size=5), min_size=1, max_size=3, unique=True)),
)


def _object(properties: dict[str, Any], required: list[bool]) -> dict[str, Any]:
    names = list(properties)
    return {
        "type": "object",
        "properties": properties,
        "required": [name for name, needed in zip(names, required, strict=False) if needed],
        "additionalProperties": False,
    }


def _extend(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    arrays = st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(1, 3))
    objects = st.builds(_object, st.dictionaries(NAMES, children, min_size=1, max_size=3),
                        st.lists(st.booleans(), min_size=3, max_size=3))
    return arrays | objects


schemas = st.builds(
    _object,
    st.dictionaries(NAMES, st.recursive(leaves, _extend, max_leaves=4), min_size=1, max_size=3),
    st.lists(st.booleans(), min_size=3, max_size=3),
)


@pytest.fixture(scope="module")
def engine(tiny_qwen2: TinyModel) -> LLMEngine:
    return make_engine(tiny_qwen2, num_kv_blocks=1024, max_num_seqs=4)


def _generate(engine: LLMEngine, params: SamplingParams, request_id: str = "r") -> tuple[str, str | None]:
    engine.add_request(request_id, PROMPT, params)
    outputs = run_to_completion(engine)[request_id]
    return "".join(o.new_text for o in outputs), outputs[-1].finish_reason


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas, seed=st.integers(0, 2**31), greedy=st.booleans())
def test_constrained_output_always_parses_and_validates(engine: LLMEngine, schema: dict, seed: int,
                                                        greedy: bool) -> None:
    params = SamplingParams(temperature=0.0 if greedy else 1.0, seed=seed, max_tokens=400,
                            grammar=GrammarSpec("json_schema", json.dumps(schema)))
    text, finish_reason = _generate(engine, params)
    assert finish_reason == "stop", text  # the grammar ended it, not the token limit
    jsonschema.validate(json.loads(text), schema)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas, seed=st.integers(0, 2**31))
def test_a_token_the_grammar_allows_keeps_the_output_valid(engine: LLMEngine, schema: dict, seed: int) -> None:
    """The sampler keeps a row's free choice when `GrammarState.allows` says yes and masks only the other
    rows. Every token the mask allows is allowed one by one (the mask may hold fewer: where the text is
    forced it keeps only its canonical tokenization), and a walk through tokens allowed one by one, not
    necessarily canonical ones, still ends in output that parses and validates."""
    rng = random.Random(seed)
    grammar = engine.grammars.matcher(GrammarSpec("json_schema", json.dumps(schema)))
    vocab_size = engine.grammars.vocab_size
    walked: list[int] = []
    while not grammar.terminated:
        bitmask = allocate_bitmask(1, vocab_size)
        grammar.fill(bitmask, 0)
        in_mask = [t for t in range(vocab_size) if allows(bitmask, 0, t)]
        assert all(grammar.allows(t) for t in in_mask)
        allowed = [t for t in range(vocab_size) if grammar.allows(t)]
        walked.append(rng.choice(allowed))
        assert grammar.accept(walked[-1])
    eos = engine.scheduler.eos_token_ids
    jsonschema.validate(json.loads(engine.tokenizer.decode([t for t in walked if t not in eos])), schema)


def test_json_object_mode_yields_one_json_object(engine: LLMEngine) -> None:
    for seed in range(4):
        text, finish_reason = _generate(
            engine, SamplingParams(temperature=1.0, seed=seed, max_tokens=400, grammar=GrammarSpec("json_object")))
        if finish_reason == "stop":  # an open object may run to the token limit; when it ends, it is whole
            assert isinstance(json.loads(text), dict)


def test_without_a_grammar_the_random_model_does_not_write_json(engine: LLMEngine) -> None:
    text, _ = _generate(engine, SamplingParams(temperature=1.0, seed=0, max_tokens=40))
    with pytest.raises(ValueError):
        json.loads(text)


def test_an_invalid_schema_is_refused_before_it_runs(engine: LLMEngine) -> None:
    params = SamplingParams(grammar=GrammarSpec("json_schema", json.dumps({"type": "objectx"})))
    with pytest.raises(GrammarError, match="objectx"):
        engine.add_request("bad", PROMPT, params)
    assert not engine.has_unfinished_requests()


def test_compiled_grammars_are_bounded_and_the_ones_in_use_are_kept(engine: LLMEngine) -> None:
    """Every client schema is a grammar of its own: the compiled ones are bounded, least recently used out."""
    grammars = Grammars(engine.tokenizer, engine.model_config.vocab_size, sorted(engine.scheduler.eos_token_ids),
                        max_cached=3)
    specs = [GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"}}}))
             for i in range(6)]
    for spec in specs:
        grammars.compile(spec)
        grammars.compile(specs[0])  # in use all along
    assert len(grammars) == 3 and specs[0] in grammars and specs[-1] in grammars and specs[1] not in grammars


def test_zero_penalties_leave_greedy_output_unchanged_and_penalties_change_it(engine: LLMEngine) -> None:
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    zero = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=0.0,
                          frequency_penalty=0.0)
    penalised = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0,
                               presence_penalty=2.0)
    engine.add_request("base", PROMPT, base)
    engine.add_request("zero", PROMPT, zero)
    engine.add_request("penalised", PROMPT, penalised)
    outputs = run_to_completion(engine)
    plain = generated_ids(outputs["base"])
    assert generated_ids(outputs["zero"]) == plain
    assert generated_ids(outputs["penalised"]) != plain
    # Strong penalties push the model away from repeating itself.
    assert len(set(generated_ids(outputs["penalised"]))) > len(set(plain))
