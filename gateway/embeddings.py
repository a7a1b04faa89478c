"""`POST /v1/embeddings`: the gateway's embedding service (router.embedding.Embedder) behind the OpenAI API.

One model, `sluice-embed` (all-MiniLM-L6-v2, 384 dimensions, unit length). `input` is a string or a
list of strings; `encoding_format` float or base64 (the `openai` SDK asks for base64 and decodes it).
"""

from __future__ import annotations

import base64
from typing import Literal

import msgspec
import numpy as np

from engines.api.errors import APIError, invalid

EMBED_MODEL = "sluice-embed"
MAX_INPUTS = 2048  # OpenAI's limit per request


class EmbeddingsRequest(msgspec.Struct, kw_only=True):
    model: str
    # Token-id arrays decode too, so that they are refused with an error that names them (`texts_of`).
    input: str | list[str | int | list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class Embedding(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingsUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(msgspec.Struct, kw_only=True):
    data: list[Embedding]
    model: str
    usage: EmbeddingsUsage
    object: str = "list"


def texts_of(request: EmbeddingsRequest, dim: int) -> list[str]:
    """The texts to embed, or a 4xx naming what is wrong."""
    if request.model != EMBED_MODEL:
        raise APIError(
            404,
            f"The model `{request.model}` does not exist; embeddings use `{EMBED_MODEL}`.",
            code="model_not_found",
            param="model",
        )
    given = [request.input] if isinstance(request.input, str) else request.input
    if not given:
        raise invalid("`input` must not be an empty list", "input", "empty_array")
    texts = [text for text in given if isinstance(text, str)]
    if len(texts) < len(given):
        # LangChain's OpenAIEmbeddings, for one, sends tiktoken's ids unless told not to: ids of another
        # tokenizer, which would embed as some other text.
        raise invalid(f"`{EMBED_MODEL}` embeds text: `input` must be a string or a list of strings. Token-id arrays "
                      "are not accepted (clients that count tokens with tiktoken send them, e.g. LangChain's "
                      "OpenAIEmbeddings unless `check_embedding_ctx_length=False`).", "input")
    if len(texts) > MAX_INPUTS:
        raise invalid(f"`input` holds {len(texts)} texts; at most {MAX_INPUTS} per request", "input")
    if any(not text for text in texts):
        raise invalid("`input` must not contain empty strings", "input")
    if request.dimensions is not None and request.dimensions != dim:
        raise invalid(f"`{EMBED_MODEL}` has {dim} dimensions; `dimensions` cannot change that", "dimensions")
    return texts


def response(vectors: np.ndarray, tokens: int, encoding: str) -> EmbeddingsResponse:
    data = [
        Embedding(index=i, embedding=_encode(vector, encoding)) for i, vector in enumerate(vectors.astype(np.float32))
    ]
    return EmbeddingsResponse(
        data=data, model=EMBED_MODEL, usage=EmbeddingsUsage(prompt_tokens=tokens, total_tokens=tokens)
    )


def _encode(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.tobytes()).decode()  # little-endian float32, as OpenAI's
    return vector.tolist()
