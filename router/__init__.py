"""Routing: which tier serves a request."""

from router.decision import ModelNotAllowed, ModelNotFound, RouteDecision, decide, model_ids, requested_tier

__all__ = ["ModelNotAllowed", "ModelNotFound", "RouteDecision", "decide", "model_ids", "requested_tier"]
