"""The OpenAI-compatible API."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, get, post, route
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from engines.api.errors import APIError
from engines.api.fields import keep_extra_fields
from engines.api.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from gateway import responses
from gateway.controllers.http import cancel_on_disconnect, reply_response
from gateway.embeddings import EMBED_MODEL, EmbeddingsRequest
from gateway.pipeline import Gateway, RequestState, request_ids
from gateway.responses import ResponsesRequest
from router.decision import ModelNotFound, model_ids, requested_tier


async def authenticated(request: Request[Any, Any, Any]) -> None:
    """Start the request's record and authenticate it, before the body is read: a request without
    a valid key gets 401 whatever its body. A `before_request` hook rather than a guard: Litestar
    copies the route handler for every guard call, on every request."""
    gateway: Gateway = request.app.state.gateway
    headers = request.headers
    request_id, response_id = request_ids(headers.get("x-request-id"))
    endpoint = request.route_handler.opt.get("endpoint", "")
    state = RequestState(request_id=request_id, endpoint=endpoint, response_id=response_id,
                         asked_priority=headers.get("x-sluice-priority"))  # fmt: skip
    state.cache_control = headers.get("cache-control")
    request.state.sluice = state
    state.principal = await gateway.authenticate(headers.get("authorization"))


class OpenAIController(Controller):
    path = "/v1"
    before_request = authenticated

    @post("/chat/completions", opt={"endpoint": "chat"}, status_code=200, summary="Create a chat completion")
    async def chat_completions(
        self, request: Request[Any, Any, Any], data: JSONBody[ChatCompletionRequest], gateway: NamedDependency[Gateway]
    ) -> Response[Any]:
        keep_extra_fields(data, await request.body())
        return reply_response(await cancel_on_disconnect(request, gateway.chat(request.state.sluice, data)))

    @post("/completions", opt={"endpoint": "completions"}, status_code=200, summary="Create a text completion")
    async def completions(
        self, request: Request[Any, Any, Any], data: JSONBody[CompletionRequest], gateway: NamedDependency[Gateway]
    ) -> Response[Any]:
        keep_extra_fields(data, await request.body())
        return reply_response(await cancel_on_disconnect(request, gateway.complete(request.state.sluice, data)))

    # Served as a chat completion (routing, cache, accounting): its endpoint is that one's.
    @post("/responses", opt={"endpoint": responses.SERVED_AS}, status_code=200, summary="Create a model response")
    async def responses(
        self, request: Request[Any, Any, Any], data: JSONBody[ResponsesRequest], gateway: NamedDependency[Gateway]
    ) -> Response[Any]:
        return reply_response(await cancel_on_disconnect(request, responses.serve(gateway, request.state.sluice, data)))

    @route(["/responses/{response_id:str}", "/responses/{response_id:str}/input_items",
            "/responses/{response_id:str}/cancel"], http_method=["GET", "POST", "DELETE"],
           opt={"endpoint": "responses"}, summary="Stored responses: none (Sluice stores no responses)")
    async def stored_response(self, request: Request[Any, Any, Any], response_id: FromPath[str]) -> None:
        request.state.sluice.finished = True  # not a served request: no accounting row
        raise APIError(404, f"No response `{response_id}`: Sluice stores no responses; send the whole "
                            "conversation in `input`.", code="not_found", param="response_id")

    @post("/embeddings", opt={"endpoint": "embeddings"}, status_code=200, summary="Create embeddings")
    async def embeddings(
        self, request: Request[Any, Any, Any], data: JSONBody[EmbeddingsRequest], gateway: NamedDependency[Gateway]
    ) -> Response[Any]:
        return reply_response(await cancel_on_disconnect(request, gateway.embeddings(request.state.sluice, data)))

    @get("/models", opt={"endpoint": "models"}, summary="List the models")
    async def models(self, request: Request[Any, Any, Any], gateway: NamedDependency[Gateway]) -> ModelList:
        # Listing is not a served request: it leaves no accounting row.
        request.state.sluice.finished = True
        return ModelList(data=[ModelCard(id=model) for model in served_models(gateway)])

    @get("/models/{model_id:str}", opt={"endpoint": "models"}, summary="Retrieve a model")
    async def model(
        self, request: Request[Any, Any, Any], model_id: FromPath[str], gateway: NamedDependency[Gateway]
    ) -> ModelCard:
        request.state.sluice.finished = True
        if not serves(gateway, model_id):
            raise APIError(404, f"The model `{model_id}` does not exist. GET /v1/models lists the models.",
                           code="model_not_found", param="model")
        return ModelCard(id=model_id)


def served_models(gateway: Gateway) -> list[str]:
    """What clients may name as `model`: the tiers, the router, and the embedding model where it is served."""
    return model_ids(gateway.clients) + ([EMBED_MODEL] if gateway.embedder is not None else [])


def serves(gateway: Gateway, model: str) -> bool:
    """Whether a request may name `model`: a listed name, or a tier's bare name (`small`), which chat accepts too."""
    if model in served_models(gateway):
        return True
    try:
        requested_tier(model, gateway.clients)
    except ModelNotFound:
        return False
    return True
