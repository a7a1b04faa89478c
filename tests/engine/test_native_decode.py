"""Decode rows through whole native layers (`NativeDecoder` over `decode_layer_int8`): what the PyTorch modules
compute, the same K/V written to the paged cache, each row the same bits whatever shares its step (other decode
rows, a prefill chunk), and only where every product of the model is one kind the kernel takes on float32
activations: int8 weight-only, or w8a8 (on AMX tiles, or through VNNI dot products)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engines import quantization
from engines.config import ModelConfig
from engines.cpu_kernels import LayerProducts, decode_layer, w8a8_amx, w8a8_vnni
from engines.llm_engine import LLMEngine
from engines.model_runner import ModelRunner, TokenSpan
from engines.models import llama
from engines.models.llama import LlamaForCausalLM
from engines.quantization import quantize_model
from engines.sampling_params import SamplingParams
from tests.engine.conftest import TinyModel, generated_ids, make_engine, run_to_completion

pytestmark = pytest.mark.skipif(
    decode_layer() is None, reason="the native decode layer needs AVX2, FMA and a C compiler; this machine lacks one"
)

# Three sequences in blocks of 4 tokens, each in blocks of its own: prompt tokens and block table.
SEQUENCES = [
    (list(range(5, 18)), [0, 1, 2, 3, 4]),
    (list(range(40, 47)), [8, 9, 10]),
    (list(range(90, 111)), [12, 13, 14, 15, 16, 17, 18]),
]


# The products the native layers take on this CPU: int8 weight-only everywhere (AVX2), w8a8 on AMX tiles and
# through VNNI dot products where the CPU has them (an AMX CPU runs the VNNI kernel too).
PRODUCTS = ["int8", *(["w8a8-amx"] if w8a8_amx() is not None else []),
            *(["w8a8-vnni"] if w8a8_vnni() is not None else [])]


@pytest.fixture(params=PRODUCTS)
def products(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "w8a8-vnni":  # what a CPU with VNNI and no AMX builds
        monkeypatch.setattr(quantization, "w8a8_tiled", w8a8_vnni)
    return str(request.param)


def native_engine(model: TinyModel, products: str = "int8", **overrides: object) -> LLMEngine:
    return make_engine(model, quantization=products.split("-")[0], num_threads=2, **overrides)


def prefill(runner: ModelRunner, *indices: int) -> list[TokenSpan]:
    """Cache the prompts of SEQUENCES[i]; return each one's next decode row."""
    spans = []
    for i in indices:
        prompt, table = SEQUENCES[i]
        runner.forward([TokenSpan(prompt, 0, table, "none")])
        spans.append(TokenSpan([200 + i], len(prompt), table))
    return spans


def decode_slots(runner: ModelRunner, spans: list[TokenSpan]) -> list[torch.Tensor]:
    """Every layer's K and V at the decode rows' slots."""
    size = runner.block_size
    slots = torch.tensor([span.block_table[span.start // size] * size + span.start % size for span in spans])
    return [cache.index_select(0, slots).float() for pair in runner.kv_caches for cache in pair]


def native_layers_run(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The indices of the layers that decode rows go through natively from here on, in order."""
    layers_run: list[int] = []
    run_layer = llama.PreparedDecodeRows.run_layer

    def counted(rows: llama.PreparedDecodeRows, index: int, x: torch.Tensor) -> None:
        layers_run.append(index)
        run_layer(rows, index, x)

    monkeypatch.setattr(llama.PreparedDecodeRows, "run_layer", counted)
    return layers_run


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16"])
def test_native_layers_compute_the_modules_logits_and_write_their_kv(tiny_model: TinyModel, kv_cache_dtype: str,
                                                                     products: str) -> None:
    runner = native_engine(tiny_model, products, kv_cache_dtype=kv_cache_dtype).runner
    assert runner.native_decoder is not None
    expected = {"int8": LayerProducts.INT8_WEIGHT_ONLY, "w8a8-amx": LayerProducts.W8A8_AMX,
                "w8a8-vnni": LayerProducts.W8A8_VNNI}[products]
    assert runner.native_decoder.shape.products == expected
    spans = prefill(runner, 0, 1, 2)
    native_logits = runner.forward(spans)
    native_kv = decode_slots(runner, spans)
    modules_match = runner.native_decoder.modules_match
    runner.native_decoder = None
    module_logits = runner.forward(spans)  # the same slots, written again by the modules
    module_kv = decode_slots(runner, spans)
    for native in native_kv:
        assert native.abs().max() > 0  # written (the cache starts as zeros)
    if modules_match:
        # w8a8 in tile order: the modules' products, norms, SiLU and attention are the layers' own C code.
        assert torch.equal(native_logits, module_logits)
        assert all(torch.equal(native, module) for native, module in zip(native_kv, module_kv, strict=True))
        return
    # Int8 weight-only: the modules' SiLU is torch's, a few ulp from the layers', which can move an activation across
    # a rounding boundary (int16: 1/8191 of its row's largest) or a K/V value across a bfloat16 one: small, where a
    # wrong RoPE, norm, bias or residual is of the order of the logits themselves.
    torch.testing.assert_close(native_logits, module_logits, rtol=0, atol=2e-3 * module_logits.abs().max().item())
    for native, module in zip(native_kv, module_kv, strict=True):
        torch.testing.assert_close(native, module, rtol=1e-2, atol=1e-3 * module.abs().max().item())


def test_w8a8_layers_take_the_attention_projections_inputs_in_two_passes(tiny_qwen2: TinyModel, products: str) -> None:
    """Above, the native layers give the modules' bits with these passes: the C code runs the second pass too."""
    for setting, expected in ((2, [2, 2, 1, 1]), (1, [1, 1, 1, 1])):
        decoder = native_engine(tiny_qwen2, products, w8a8_attention_passes=setting).runner.native_decoder
        assert decoder is not None
        weights = decoder.layers[0][0]
        passes = [getattr(weights, name).activation_passes for name in ("qkv", "o", "gate_up", "down")]
        assert passes == ([1, 1, 1, 1] if products == "int8" else expected)
    with pytest.raises(ValueError, match="w8a8_attention_passes is 1 or 2"):
        native_engine(tiny_qwen2, products, w8a8_attention_passes=3)


@pytest.mark.skipif(w8a8_amx() is None and w8a8_vnni() is None, reason="w8a8 native layers need VNNI or AMX")
def test_a_gate_up_product_in_two_passes_keeps_the_modules(tiny_qwen2: TinyModel) -> None:
    """The native layer combines gate and up in one pass only."""
    config = tiny_qwen2.checkpoint.config
    model = LlamaForCausalLM(config, max_positions=64)
    quantize_model(model, "w8a8", torch.float32, two_pass=lambda name: name.endswith("gate_up_proj"))
    assert ModelRunner(model, config, 4, num_kv_blocks=8, kv_cache_dtype=torch.float32).native_decoder is None
    quantize_model(model := LlamaForCausalLM(config, max_positions=64), "w8a8", torch.float32)
    assert ModelRunner(model, config, 4, num_kv_blocks=8, kv_cache_dtype=torch.float32).native_decoder is not None


def test_a_decode_row_is_the_same_bits_alone_beside_other_rows_and_beside_a_prefill_chunk(
    tiny_qwen2: TinyModel, products: str
) -> None:
    runner = native_engine(tiny_qwen2, products).runner
    assert runner.native_decoder is not None
    first, second = prefill(runner, 0, 1)
    third_prompt, third_table = SEQUENCES[2]
    alone = runner.forward([first])
    beside_a_row = runner.forward([second, first])[1]
    chunk = TokenSpan(third_prompt, 0, third_table, "last")
    beside_a_chunk, chunk_logits = runner.forward([first, chunk])
    assert torch.equal(beside_a_row, alone[0])
    assert torch.equal(beside_a_chunk, alone[0])
    # The chunk, computed apart from the decode rows, is what it is alone.
    assert torch.equal(chunk_logits, runner.forward([chunk])[0])


def test_beside_a_prefill_chunk_decode_rows_join_the_modules_only_where_they_give_the_same_bits(
    tiny_qwen2: TinyModel, products: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step with a prefill chunk reads each layer's weights once for all its rows where the modules compute a
    decode row to the native layers' bits (w8a8 in tile order); with int8 weight-only every row goes through the
    native layers, the chunk's as decode rows too (a prompt alone as well)."""
    runner = native_engine(tiny_qwen2, products).runner
    layers_run = native_layers_run(monkeypatch)
    first, = prefill(runner, 0)
    third_prompt, third_table = SEQUENCES[2]
    runner.forward([first, TokenSpan(third_prompt, 0, third_table, "last")])
    assert runner.native_decoder is not None and runner.native_decoder.modules_match == (products != "int8")
    every_layer = list(range(tiny_qwen2.checkpoint.config.num_hidden_layers))
    assert layers_run == ([] if products != "int8" else every_layer * 2)  # the first prompt, then the step


@pytest.mark.skipif(w8a8_amx() is None and w8a8_vnni() is None, reason="w8a8 native layers need VNNI or AMX")
def test_an_mlp_whose_gate_up_halves_are_not_whole_tile_groups_keeps_its_decode_rows_native() -> None:
    """There the modules' SiLU is torch's, not the native layers': beside a prefill chunk they would differ in bits."""
    config = ModelConfig(architecture="qwen2", vocab_size=96, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         attention_bias=True)  # fmt: skip
    decoders = []
    for intermediate_size in (96, 128):
        model = LlamaForCausalLM(dataclasses.replace(config, intermediate_size=intermediate_size), max_positions=64)
        quantize_model(model, "w8a8", torch.float32)
        runner = ModelRunner(model, model.config, 4, num_kv_blocks=8, kv_cache_dtype=torch.float32)
        decoders.append(runner.native_decoder)
    assert all(decoder is not None for decoder in decoders)
    assert [decoder.modules_match for decoder in decoders] == [False, True]


def test_decoding_through_native_layers_gives_the_modules_tokens(tiny_model: TinyModel, products: str) -> None:
    outputs = []
    for native in (True, False):
        engine = native_engine(tiny_model, products)
        assert engine.runner.native_decoder is not None
        if not native:
            engine.runner.native_decoder = None
        for i, (prompt, _) in enumerate(SEQUENCES):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        outputs.append({request: generated_ids(out) for request, out in run_to_completion(engine).items()})
    assert outputs[0] == outputs[1]


def test_every_layer_of_a_step_runs_natively_once(tiny_llama: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = native_engine(tiny_llama).runner
    decode_rows = prefill(runner, 0)
    layers_run = native_layers_run(monkeypatch)
    runner.forward(decode_rows)
    assert layers_run == list(range(tiny_llama.checkpoint.config.num_hidden_layers))


@pytest.mark.parametrize(
    "overrides",
    [{}, {"quantization": "w8a8"}, {"quantization": "int4"}, {"quantization": "int8", "dtype": "bfloat16"},
     {"quantization": "w8a8", "dtype": "bfloat16"}],
    ids=["float32", "w8a8", "int4", "int8-bfloat16-activations", "w8a8-bfloat16-activations"],
)
def test_models_whose_products_the_native_layers_do_not_take_keep_the_modules(tiny_qwen2: TinyModel,
                                                                              overrides: dict[str, object]) -> None:
    if overrides == {"quantization": "w8a8"} and len(PRODUCTS) > 1:
        pytest.skip("this CPU's w8a8 products are taken natively (tested above)")
    engine = make_engine(tiny_qwen2, **overrides)
    assert engine.runner.native_decoder is None


def answers(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple]:
    """Each request's tokens, chosen and top logprobs, and prompt tokens found cached, run together to completion."""
    for name, (prompt, params) in requests.items():
        engine.add_request(name, prompt, params)
    outputs = run_to_completion(engine)
    return {name: (generated_ids(outputs[name]), [(lp.logprob, lp.top) for out in outputs[name] for lp in out.logprobs],
                   outputs[name][0].num_cached_tokens) for name in requests}


@pytest.mark.parametrize("batch_invariant", [True, False], ids=["batch_invariant", "default"])
def test_a_batch_invariant_engine_gives_a_request_the_same_bits_however_it_is_batched_chunked_or_cached(
    tiny_qwen2: TinyModel, products: str, batch_invariant: bool
) -> None:
    """With `batch_invariant`, a request's tokens and logprobs are the same bits alone with its prompt in one chunk,
    and in 5-token chunks beside another request decoding, after a request that left part of its prompt in the
    prefix cache; seeded sampling too. Its prompt's tokens then attend as decode rows: alone, more of them than the
    native layers take at once (int8 weight-only then runs them as several forwards, its modules being other bits).
    An int8 weight-only engine prefills so by default: it is batch invariant without the option."""
    if not batch_invariant and products != "int8":
        pytest.skip("w8a8 prefills in chunks unless asked to be batch invariant")
    prompt = list(range(60, 120))
    assert len(prompt) > decode_layer().max_rows  # type: ignore[union-attr]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True)
    sampled = SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=2, seed=7)
    alone = native_engine(tiny_qwen2, products, batch_invariant=batch_invariant, max_num_batched_tokens=64,
                          enable_prefix_caching=False)
    expected = answers(alone, {"greedy": (prompt, greedy)}) | answers(alone, {"sampled": (prompt, sampled)})

    busy = native_engine(tiny_qwen2, products, batch_invariant=batch_invariant, max_num_batched_tokens=5)
    answers(busy, {"warm": ([*prompt[:17], 1, 2, 3], greedy)})  # leaves the prompt's first 16 tokens cached
    other = (list(range(200, 211)), dataclasses.replace(greedy, max_tokens=30))
    tokens, logprobs, cached = answers(busy, {"other": other, "greedy": (prompt, greedy)})["greedy"]
    assert (tokens, logprobs) == expected["greedy"][:2] and cached == 16
    tokens, logprobs, cached = answers(busy, {"sampled": (prompt, sampled), "other": other})["sampled"]
    assert (tokens, logprobs) == expected["sampled"][:2] and cached == 56  # the greedy run's blocks too
    beside_sampled = answers(busy, {"greedy": (prompt, greedy), "sampled": (list(range(300, 320)), sampled)})
    assert beside_sampled["greedy"][:2] == expected["greedy"][:2]  # its logprobs from the same pass either way


def test_batch_invariance_is_refused_where_rows_depend_on_their_neighbours(tiny_qwen2: TinyModel) -> None:
    with pytest.raises(ValueError, match="batch_invariant needs"):
        make_engine(tiny_qwen2, batch_invariant=True)  # float32: products whose bits depend on the row count
