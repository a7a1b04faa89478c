"""The engine: requests in, incremental outputs out, one `step()` at a time.

`LLMEngine` is synchronous and single-threaded (scheduler → model runner → sampler →
detokenizer). `AsyncLLMEngine` runs it on the process's step thread (`engines.step_thread`) and
streams per-request outputs to asyncio consumers; it is the API the engine HTTP server and
in-process tiers build on.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import logging
import os
import random
import time
import weakref
from collections.abc import AsyncIterator, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch

from engines.attention import StepYielded
from engines.block_manager import BlockManager
from engines.config import EngineConfig, ModelConfig
from engines.cpu import has_native_bf16, keep_freed_memory, release_free_memory
from engines.detokenizer import IncrementalDetokenizer
from engines.loader import Checkpoint, load_checkpoint
from engines.model_runner import ModelRunner, ScoredChunk, kv_block_bytes
from engines.models import model_class
from engines.outputs import EngineOverloaded, EngineStepFailed, RequestOutput, TokenLogprob
from engines.quantization import (
    Int8Embedding,
    onednn_available,
    pack_float_linears,
    quantize_model,
    resolve_quantization,
)
from engines.sampler import GreedyTokens, greedy_logprobs, greedy_only, sample, token_logprobs
from engines.sampling_params import SamplingParams
from engines.scheduler import ScheduledBatch, Scheduler
from engines.sequence import Sequence
from engines.speculative import Speculator, weight_bytes
from engines.step_thread import STEP_THREAD
from engines.structured import Grammars
from engines.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_preempted_total: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int  # includes cached blocks that no request holds (evictable)
    prefix_cache_queries_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int
    num_generated_tokens_total: int
    num_aborted_total: int = 0  # requests dropped before they finished (client gone, step failed)
    num_waiting_batch: int = 0  # of num_waiting: batch-priority sequences (the rest are interactive)
    num_running_batch: int = 0  # of num_running
    num_yielded_steps_total: int = 0  # batch-only steps given up for an interactive request that arrived


def physical_core_count() -> int:
    """Physical cores this process may run on (SMT siblings counted once): the right intra-op thread count."""
    allowed = os.sched_getaffinity(0)
    cores = set()
    for cpu in allowed:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        cores.add(siblings.read_text().strip() if siblings.exists() else str(cpu))
    return max(1, len(cores))


def context_length(config: EngineConfig, model_config: ModelConfig) -> int:
    """Tokens one sequence may hold, prompt and output together: the configured limit within the model's
    positions."""
    return min(config.max_model_len, model_config.max_position_embeddings)


def resolve_device(name: str) -> torch.device:
    """The engine's device: "cpu", or "cuda[:N]" where PyTorch sees that GPU."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unsupported device {name!r}; expected 'cpu' or 'cuda[:N]'") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"unsupported device {name!r}; expected 'cpu' or 'cuda[:N]'")
    if not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} requested but PyTorch sees no such CUDA device")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def resolve_kv_cache_dtype(name: str | None, dtype: torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """The KV cache's dtype: `name` ("auto": bfloat16 on CUDA and where the CPU has it natively), by default
    `dtype`."""
    if name is None:
        return dtype
    if name == "auto":
        on_cuda = device is not None and device.type == "cuda"
        return torch.bfloat16 if on_cuda or has_native_bf16() else dtype
    if name not in DTYPES:
        raise ValueError(f"unsupported kv_cache_dtype {name!r}; expected auto or one of {sorted(DTYPES)}")
    return DTYPES[name]


def build_model(model_config: ModelConfig, tensors: MutableMapping[str, torch.Tensor], dtype: torch.dtype,
                max_positions: int, *, consume: bool = False,
                on_layer_loaded: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module:
    """Instantiate the architecture without random init, in `dtype`, and load `tensors` into it
    (`on_layer_loaded`: see `load_weights`)."""
    with torch.device("meta"):
        model = model_class(model_config)(model_config, max_positions=max_positions)
    model = model.to(dtype)
    model.load_weights(tensors, consume=consume, on_layer_loaded=on_layer_loaded)
    return model.eval()


# Models loaded from a file, by what makes two loads alike: an engine over a model that another engine in the
# process already serves shares its weights instead of loading a copy (`make run`: the large tier's drafter is
# the small tier's model). Weak: a model goes with the last engine using it. A forward pass only reads them.
_LOADED_MODELS: weakref.WeakValueDictionary[tuple[object, ...], torch.nn.Module] = weakref.WeakValueDictionary()


def weight_sharing_twin(model: torch.nn.Module) -> torch.nn.Module:
    """Another module over the same submodules (no copy): a submodule it then replaces (a drafter's cut head)
    is replaced in it alone. It keeps `model`, and so `model`'s place among the loaded models, alive."""
    twin = copy.copy(model)
    twin._modules = dict(model._modules)
    object.__setattr__(twin, "shares_weights_of", model)  # a plain attribute, not a submodule
    return twin


def check_same_vocabulary(target: ModelConfig, target_tokenizer: Tokenizer, drafter: ModelConfig,
                          drafter_tokenizer: Tokenizer, drafter_name: str) -> None:
    """A drafter must speak the target's token ids: same vocabulary size and the same token for every id."""
    same_size = target.vocab_size == drafter.vocab_size and target_tokenizer.vocab_size == drafter_tokenizer.vocab_size
    # Every 97th id is enough to tell two different tokenizers apart; all of them would take seconds.
    if not same_size or any(target_tokenizer.token_bytes(i) != drafter_tokenizer.token_bytes(i)
                            for i in range(0, target_tokenizer.vocab_size, 97)):
        raise ValueError(f"speculative drafter {drafter_name} does not share the target's vocabulary")


class LLMEngine:
    """Continuous-batching inference over a paged KV cache with prefix caching.

    Not thread-safe: one thread calls `add_request`, `abort_request` and `step` (AsyncLLMEngine
    does exactly that).
    """

    def __init__(self, config: EngineConfig) -> None:
        # The checkpoint is ours alone: its tensors are freed as they are copied into the model.
        self._setup(load_checkpoint(config.model), config, consume_checkpoint=True)

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, config: EngineConfig, drafter: Checkpoint | None = None
                        ) -> LLMEngine:
        """An engine over an already loaded checkpoint (`config.model` is then only a label), with an
        already loaded speculative drafter (`config.speculative_model` is then only a label)."""
        engine = cls.__new__(cls)
        engine._setup(checkpoint, config, drafter=drafter)
        return engine

    def _setup(self, checkpoint: Checkpoint, config: EngineConfig, consume_checkpoint: bool = False,
               drafter: Checkpoint | None = None) -> None:
        if config.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {config.dtype!r}; expected one of {sorted(DTYPES)}")
        self.device = resolve_device(config.device)
        # Set by whoever feeds the engine (AsyncLLMEngine): whether an interactive request waits to be added.
        # A step of batch work alone is given up between layers once it does (`ScheduledBatch.yields_to_interactive`).
        self.interactive_waiting: Callable[[], bool] | None = None
        self._num_yielded_steps_total = 0
        self.num_threads = config.num_threads or physical_core_count()
        torch.set_num_threads(self.num_threads)
        self.config = config
        self.model_config = checkpoint.config
        self.tokenizer: Tokenizer = checkpoint.tokenizer
        self.dtype = DTYPES[config.dtype]
        self.max_model_len = context_length(config, self.model_config)
        self.quantization = resolve_quantization(config.quantization, self.device.type)
        self.model = self._load_model(checkpoint, consume_checkpoint, config.model if consume_checkpoint else None)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        num_kv_blocks = config.num_kv_blocks or config.kv_cache_bytes // kv_block_bytes(
            self.model_config, config.block_size, self.kv_cache_dtype)
        if num_kv_blocks < 1:
            raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} holds no KV block; raise it")
        self.block_manager = BlockManager(num_kv_blocks, config.block_size, config.enable_prefix_caching)
        eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   eos_token_ids, config.max_batch_tokens_beside_interactive)
        self._speculative = drafter is not None or bool(config.speculative_model)
        self.runner = ModelRunner(self.model, self.model_config, config.block_size, num_kv_blocks,
                                  self.kv_cache_dtype, self.device, self.max_model_len, self._graph_max_batch(),
                                  batch_invariant=config.batch_invariant)
        self.speculator = None
        if self._speculative:
            self.speculator = self._load_speculator(num_kv_blocks, drafter)
        release_free_memory()  # what loading freed (dequantised tensors), still mapped by malloc
        keep_freed_memory()  # from here on what a step frees serves the next one
        self._rng = random.Random(config.seed)
        self._grammars: Grammars | None = None
        self._requests: dict[str, Sequence] = {}
        self._num_generated_tokens_total = 0
        self._num_aborted_total = 0

    @property
    def grammars(self) -> Grammars:
        """The grammar compiler for constrained decoding, built on first use (it indexes the vocabulary)."""
        if self._grammars is None:
            eos = sorted(self.scheduler.eos_token_ids)
            self._grammars = Grammars(self.tokenizer, self.model_config.vocab_size, eos)
        return self._grammars

    def _load_model(self, checkpoint: Checkpoint, consume: bool, source: str | None = None) -> torch.nn.Module:
        """The model of `checkpoint` with this engine's settings; with `source` (the file it was read from) the one
        another engine of this process loaded alike, if any (`_LOADED_MODELS`)."""
        if source is None or self.device.type != "cpu":
            return self._build_model(checkpoint, consume)
        stat = os.stat(source)
        key = (os.path.realpath(source), stat.st_size, stat.st_mtime_ns, self.dtype, self.quantization,
               self.config.w8a8_attention_passes, self.max_model_len)
        model = _LOADED_MODELS.get(key)
        if model is None:
            model = _LOADED_MODELS[key] = self._build_model(checkpoint, consume)
        else:
            logger.info("%s: weights shared with an engine already serving %s", self.config.model, source)
        return model

    def _two_pass_layers(self, config: ModelConfig) -> Callable[[str], bool] | None:
        """Which w8a8 layers take their inputs in two int8 passes (`EngineConfig.w8a8_attention_passes`)."""
        return model_class(config).is_attention_projection if self.config.w8a8_attention_passes == 2 else None

    def _build_model(self, checkpoint: Checkpoint, consume: bool) -> torch.nn.Module:
        config = self.config
        quantize = None
        if self.quantization is not None:
            # With float32 activations, int8 weight-only layers run prefill chunks through sgemm on the
            # weights dequantised a layer at a time: it beats the packed kernel there.
            quantize = functools.partial(quantize_model, mode=self.quantization, activation_dtype=self.dtype,
                                         dequantize_many_rows=self.dtype == torch.float32,
                                         device_type=self.device.type,
                                         two_pass=self._two_pass_layers(checkpoint.config))
        # Each decoder layer is quantised as soon as it is loaded: the float32 model is never whole.
        model = build_model(checkpoint.config, checkpoint.tensors, self.dtype, self.max_model_len, consume=consume,
                            on_layer_loaded=quantize)
        if quantize is not None:
            tied = model.lm_head is None
            model.untie_lm_head()
            quantize(model)  # a tied head (an untied one was quantised as soon as it was loaded)
            # The float32 embedding table goes too (a tied head's int8 table serves both).
            model.embed_tokens = Int8Embedding.from_embedding(model.embed_tokens, self.dtype,
                                                              model.lm_head if tied else None)
            logger.info("%s: weights quantised %s (requested %s)", config.model, self.quantization, config.quantization)
        elif self.device.type == "cpu" and self.dtype == torch.float32 and onednn_available():
            # float32 only: oneDNN's bfloat16 products need CPU support an AVX2 CPU lacks; not measured in the engine.
            tied = model.lm_head is None
            model.untie_lm_head()
            pack_float_linears(model, frozenset({"lm_head"}) if tied else frozenset())
        if self.device.type != "cpu":
            model.move_to(self.device)  # loaded and quantised on the host, a layer at a time, then moved whole
        return model

    def _graph_max_batch(self) -> int:
        """Decode rows a step can hold (a speculative round verifies k + 1 per sequence), within the configured
        CUDA-graph limit."""
        config = self.config
        rows_per_seq = 1 + config.num_speculative_tokens if self._speculative else 1
        return min(config.cuda_graph_max_batch, config.max_num_seqs * rows_per_seq)

    def _load_speculator(self, num_kv_blocks: int, checkpoint: Checkpoint | None) -> Speculator:
        """The drafter: same precision settings, a KV cache of its own with the target's block layout."""
        name = str(self.config.speculative_model or "drafter")
        owned = checkpoint is None
        if checkpoint is None:
            checkpoint = load_checkpoint(name)
        check_same_vocabulary(self.model_config, self.tokenizer, checkpoint.config, checkpoint.tokenizer, name)
        # A twin: the head cut below must not cut that of an engine serving this model too.
        model = weight_sharing_twin(self._load_model(checkpoint, consume=owned, source=name if owned else None))
        draft_bytes = weight_bytes(model)
        if self.config.speculative_draft_vocab is not None and hasattr(model, "limit_vocabulary"):
            draft_bytes -= model.limit_vocabulary(self.config.speculative_draft_vocab)
        runner = ModelRunner(model, checkpoint.config, self.config.block_size, num_kv_blocks, self.kv_cache_dtype,
                             self.device, self.max_model_len, self._graph_max_batch(),
                             batch_invariant=self.config.batch_invariant)
        return Speculator(runner, self.config.num_speculative_tokens, draft_bytes / weight_bytes(self.model),
                          self.runner.forward_cost, self.config.speculative_adaptive_drafts)

    # -- requests ----------------------------------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError, with a message fit for the caller, if the request can never be served.

        The engine is a library with callers of its own (benchmarks, tests), so it keeps its
        preconditions; requests that come through the OpenAI layer have passed the contract's
        rules (`engines.api.rules`) and fail here only on the KV-cache capacity, which only the
        engine knows."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("the prompt is empty; at least one token is required")
        vocab_size = self.model_config.vocab_size
        if any(not 0 <= token_id < vocab_size for token_id in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        if any(not 0 <= token_id < vocab_size for token_id in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
        if params.grammar is not None:
            self.grammars.compile(params.grammar)  # raises GrammarError (a ValueError) on a bad schema
        if num_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {num_prompt} prompt "
                f"tokens + {params.max_tokens} max_tokens were requested; shorten the prompt or lower max_tokens")
        num_blocks = self.block_manager.num_blocks_for(num_prompt + params.max_tokens)
        if num_blocks > self.block_manager.num_blocks:
            raise ValueError(
                f"{num_prompt} prompt tokens + {params.max_tokens} max_tokens need {num_blocks} KV-cache blocks but "
                f"the engine has {self.block_manager.num_blocks}; shorten the request")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; its outputs come from later `step()` calls. Raises ValueError on bad input."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_token_ids, params)
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            generator = torch.Generator().manual_seed(seed)
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop, params.min_tokens)
        seq = Sequence(request_id, prompt_token_ids, params, generator, detokenizer)
        if params.grammar is not None:
            seq.grammar = self.grammars.matcher(params.grammar)
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> Sequence | None:
        """Drop a request and free its KV blocks; returns it, or None for unknown or finished ids."""
        seq = self._requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")
            self._num_aborted_total += 1
        return seq

    def abort_all(self) -> list[str]:
        """Drop every request (a step failed); returns their ids."""
        request_ids = list(self._requests)
        for request_id in request_ids:
            self.abort_request(request_id)
        return request_ids

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return one delta per request that produced a token."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        if self.speculator is not None and not batch.scores_prompt:
            outputs = self._speculative_step(batch, self.speculator)
            if outputs is not None:
                return outputs
        should_yield = self.interactive_waiting if batch.yields_to_interactive else None
        params = [s.params for s in batch.sampled]
        greedy = greedy_only(params, [s.grammar for s in batch.sampled]) and not batch.scores_prompt
        try:
            result, seqs, scored = self.runner.execute(batch, should_yield, greedy, any(p.logprobs for p in params))
        except StepYielded:
            self._num_yielded_steps_total += 1
            return []
        for chunk in scored:
            score_prompt(chunk)
        if isinstance(result, GreedyTokens):  # what `sample` would choose and report, from the LM head's own pass
            token_ids, logprobs = result.token_ids.tolist(), greedy_logprobs(result, params)
        else:
            token_ids, logprobs = ([], []) if not seqs else sample(
                result, [s.params for s in seqs], [s.generator for s in seqs],
                [s.output_token_ids for s in seqs], [s.grammar for s in seqs], [s.token_ids for s in seqs],
                self.scheduler.eos_token_ids)
        texts = self.scheduler.postprocess(batch, token_ids)
        self._num_generated_tokens_total += len(seqs)
        outputs = []
        for seq, token_id, text, logprob in zip(seqs, token_ids, texts, logprobs, strict=True):
            if seq.is_finished:
                del self._requests[seq.request_id]
            outputs.append(_delta(seq, [token_id], text, [logprob]))
        return outputs

    def _speculative_step(self, batch: ScheduledBatch, speculator: Speculator) -> list[RequestOutput] | None:
        """A draft-and-verify round when every scheduled sequence decodes and the cache has room; else None."""
        seqs = batch.seqs
        if any(num_new != 1 for num_new in batch.num_new_tokens):
            return None  # prefill chunks in the step: a plain step (the drafter catches up at the next round)
        if not all(_speculable(seq) for seq in seqs):
            return None
        k = speculator.num_drafts(seqs, self.max_model_len)
        manager = self.block_manager
        num_needed = sum(manager.num_blocks_for(seq.num_computed_tokens + k + 1) - len(seq.block_table)
                         for seq in seqs)
        if k == 0 or num_needed > manager.num_free_blocks:
            return None
        budget = self.config.max_num_batched_tokens
        if speculator.num_behind(seqs) > budget:  # a round would start with a long catch-up: spread it over steps
            speculator.catch_up(seqs, budget, manager)
            return None
        for seq in seqs:
            manager.may_append(seq, k + 1)
        outputs = []
        for seq, result in zip(seqs, speculator.step(seqs, k, self.runner, manager), strict=True):
            num_taken, text = self.scheduler.append_tokens(seq, result.token_ids)
            self._num_generated_tokens_total += num_taken
            if seq.is_finished:
                del self._requests[seq.request_id]
            outputs.append(_delta(seq, result.token_ids[:num_taken], text, result.logprobs[:num_taken]))
        return outputs

    def precision(self) -> dict[str, str]:
        """Where and with which dtypes and quantisation this engine runs (`auto` settings resolved here), how a
        decode step's layers run (one native call each, `native:` the products' kind, or PyTorch modules), and which
        build attends decode rows (`PagedDecodeAttention.isa`, "triton" on CUDA, "pytorch" for gather + SDPA)."""
        native, attention = self.runner.native_decoder, self.runner.decode_attention
        w8a8 = self.quantization == "w8a8"
        passes = {"w8a8_attention_passes": str(self.config.w8a8_attention_passes)} if w8a8 else {}
        return {
            "device": str(self.device),
            "dtype": self.config.dtype,
            "quantization": self.quantization or "none",
            **passes,
            "kv_cache_dtype": str(self.kv_cache_dtype).removeprefix("torch."),
            "decode_layers": "modules" if native is None else f"native:{native.products.name.lower()}",
            "decode_attention": "pytorch" if attention is None else getattr(attention, "isa", "triton"),
        }

    def stats(self) -> EngineStats:
        free = self.block_manager.num_free_blocks
        total = self.block_manager.num_blocks
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_preempted_total=self.scheduler.num_preempted_total,
            kv_blocks_total=total,
            kv_blocks_used=total - free,
            kv_blocks_free=free,
            prefix_cache_queries_tokens=self.scheduler.prefix_cache_queries_tokens,
            prefix_cache_hit_tokens=self.scheduler.prefix_cache_hit_tokens,
            num_generated_tokens_total=self._num_generated_tokens_total,
            num_aborted_total=self._num_aborted_total,
            num_yielded_steps_total=self._num_yielded_steps_total,
            num_waiting_batch=self.scheduler.waiting.count("batch"),
            num_running_batch=sum(seq.params.priority == "batch" for seq in self.scheduler.running),
        )


def score_prompt(chunk: ScoredChunk) -> None:
    """Append to `seq.prompt_logprobs` the prompt tokens this chunk's rows predict (position p's row, token p + 1),
    from the first not yet scored on (a preempted sequence computes its chunks again)."""
    seq = chunk.seq
    if not seq.prompt_logprobs:
        seq.prompt_logprobs.append(None)  # the first token: nothing comes before it
    first, end = len(seq.prompt_logprobs) - 1, min(chunk.start + len(chunk.logits), seq.num_prompt_tokens - 1)
    assert first >= chunk.start, f"{seq.request_id}: positions {chunk.start}..{first} of its prompt were never scored"
    params = dataclasses.replace(seq.params, logprobs=True, top_logprobs=seq.params.prompt_logprobs or 0)
    rows = chunk.logits[first - chunk.start:end - chunk.start]
    seq.prompt_logprobs += token_logprobs(rows, seq.token_ids[first + 1:end + 1], [params] * len(rows))


def _speculable(seq: Sequence) -> bool:
    """Whether a round's acceptance test is exact for `seq`: it judges drafts by the target's raw
    (filtered) distribution, and a grammar mask, penalties, a logit bias or `min_tokens` not yet reached would
    change that distribution token by token within the round. Such sequences decode plainly (the whole step)."""
    params = seq.params
    return (seq.grammar is None and not params.penalised and not params.logit_bias
            and seq.num_output_tokens >= params.min_tokens)


def _delta(seq: Sequence, token_ids: list[int], text: str, logprobs: list[TokenLogprob | None]) -> RequestOutput:
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=token_ids,
        new_text=text,
        logprobs=[logprob for logprob in logprobs if logprob is not None],
        finished=seq.is_finished,
        finish_reason=seq.finish_reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=seq.num_cached_tokens,
        num_output_tokens=seq.num_output_tokens,
        # The first delta carries the prompt's logprobs, when asked for (a one-token prompt's: [None]).
        prompt_logprobs=(seq.prompt_logprobs or [None])
        if seq.params.prompt_logprobs is not None and seq.num_output_tokens == len(token_ids) else None,
    )


UNHEALTHY_AFTER_FAILURE_S = 5.0  # a failed step marks the engine unhealthy this long (health checks, fallback)


class AsyncLLMEngine:
    """Runs an LLMEngine's step loop on the step thread and streams outputs to asyncio consumers.

    Usage:
        engine = AsyncLLMEngine.build(config)  # loaded on the step thread, where it will run
        async for output in engine.generate("req-1", prompt_ids, SamplingParams(max_tokens=32)):
            ...  # output is a delta (RequestOutput); the last one has finished=True
        await engine.shutdown()

    All engine state is touched only by the step thread once the engine is attached; callers hand
    it commands. Consumers may live on any event loop.
    """

    def __init__(self, engine: LLMEngine) -> None:
        """Serve an engine already built; `build` also loads it on the step thread, which is faster
        to step (see `engines.step_thread`)."""
        self.engine = engine
        self._condition = STEP_THREAD.condition  # one lock with the step thread: it waits for our commands
        self._commands: list[Callable[[], None]] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]] = {}
        self._stopped = False
        self._stats = engine.stats()
        self._failed_at = float("-inf")  # monotonic time of the latest failed step
        # Streams open at once: those running plus a bounded waiting queue.
        self.capacity = engine.config.max_num_seqs + engine.config.max_num_waiting
        self.interactive_queued = 0  # interactive requests among our queued commands
        engine.interactive_waiting = STEP_THREAD.interactive_waiting
        STEP_THREAD.attach(self)

    @classmethod
    def build(cls, config: EngineConfig) -> AsyncLLMEngine:
        """Load `config`'s model on the step thread and serve it (slow: run it in a thread from async code)."""

        def load() -> LLMEngine:
            engine = LLMEngine(config)
            # Index the vocabulary for constrained decoding now (most of a second for a 152k-token vocabulary): the
            # first request with a schema validates it on the event loop, which would stall every stream that long.
            _ = engine.grammars
            return engine

        return cls(STEP_THREAD.call(load))

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Stream a request's deltas; the last one has `finished=True` and a `finish_reason`.

        Raises ValueError (on the first iteration) if the request is invalid or the id is in use.
        If the consumer stops iterating or is cancelled before the end (a client disconnect), the
        request is aborted and its KV blocks freed.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._condition:
            if self._stopped:
                raise RuntimeError("the engine is shut down")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            if len(self._streams) >= self.capacity:
                raise EngineOverloaded(f"{len(self._streams)} requests running or queued (capacity {self.capacity})")
            self._streams[request_id] = (loop, queue)
            self._submit(lambda: self._add(request_id, list(prompt_token_ids), params))
            if params.priority == "interactive":
                self.interactive_queued += 1
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._condition:
                self._streams.pop(request_id, None)
                if not finished:
                    self._submit(lambda: self.engine.abort_request(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with a `finish_reason="abort"` delta."""
        with self._condition:
            self._submit(lambda: self._abort(request_id))

    def stats(self) -> EngineStats:
        """Statistics as of the end of the latest step."""
        return self._stats

    @property
    def healthy(self) -> bool:
        """False for a while after a step failed: callers send work elsewhere meanwhile."""
        return time.monotonic() - self._failed_at >= UNHEALTHY_AFTER_FAILURE_S

    async def shutdown(self) -> None:
        """Stop stepping this engine; streams still open end with an abort delta."""
        with self._condition:
            self._stopped = True
        await asyncio.to_thread(STEP_THREAD.detach, self)
        for request_id in list(self._streams):
            self._abort(request_id)

    # -- the step thread ---------------------------------------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        """Queue `command` for the step thread (caller holds the condition)."""
        self._commands.append(command)
        self._condition.notify()

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        try:
            self.engine.add_request(request_id, prompt_token_ids, params)
        except ValueError as exc:
            self._deliver(request_id, exc)

    def _abort(self, request_id: str) -> None:
        seq = self.engine.abort_request(request_id)
        self._deliver(request_id, RequestOutput(
            request_id=request_id, new_token_ids=[], new_text="", logprobs=[], finished=True, finish_reason="abort",
            num_prompt_tokens=seq.num_prompt_tokens if seq else 0,
            num_cached_tokens=seq.num_cached_tokens if seq else 0,
            num_output_tokens=seq.num_output_tokens if seq else 0))

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._condition:
            stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, queue = stream
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            with self._condition:
                self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

    def has_work(self) -> bool:
        """Commands to run or requests to step (called with the condition held)."""
        return not self._stopped and bool(self._commands or self.engine.has_unfinished_requests())

    def run_once(self) -> None:
        """The queued commands, then one step; its outputs delivered to their streams."""
        with self._condition:
            commands, self._commands = self._commands, []
            self.interactive_queued = 0
        if torch.get_num_threads() != self.engine.num_threads:  # engines sharing the step thread differ
            torch.set_num_threads(self.engine.num_threads)
        try:
            for command in commands:
                command()
            outputs = self.engine.step()
        except Exception:  # the loop lives on: fail every in-flight request cleanly, free its blocks
            logger.exception("engine step failed; failing the requests in flight")
            self._failed_at = time.monotonic()
            for request_id in self.engine.abort_all():
                self._deliver(request_id, EngineStepFailed("the engine step failed"))
            outputs = []
        # Before delivering: a consumer that has an output sees statistics that count it.
        self._stats = self.engine.stats()
        for output in outputs:
            self._deliver(output.request_id, output)
