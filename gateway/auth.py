"""Authentication: the `Authorization` header → the `Principal` (tenant, feature, policy) asking.

A Sluice key (`sk-sluice-...`) is looked up in the key cache; without one, a request is refused
with 401 unless anonymous access is allowed (local development), where SDKs that insist on sending
some key get the anonymous principal too.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.api.errors import APIError, service_unavailable
from gateway.config import PolicyConfig, Settings
from gateway.keys import SECRET_PREFIX, ApiKey, KeyCache, KeyStoreUnavailable, effective_policy


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is asking, and the policy that applies to them."""

    key_id: str | None
    tenant: str
    feature: str
    policy: PolicyConfig

    @property
    def subject(self) -> str:
        """Whose counters a request moves: the key, or the anonymous tenant/feature."""
        return self.key_id or f"anonymous:{self.tenant}:{self.feature}"


class Authenticator:
    def __init__(self, settings: Settings, keys: KeyCache | None) -> None:
        self.settings = settings
        self.keys = keys
        # A key's principal, kept while the key cache returns the same key object.
        self._principals: dict[str, tuple[ApiKey, Principal]] = {}

    async def authenticate(self, authorization: str | None) -> Principal:
        if not authorization:
            if self.settings.server.allow_anonymous:
                return self.anonymous()
            raise APIError(
                401,
                "You didn't provide an API key. Send it as `Authorization: Bearer sk-sluice-...`.",
                code="invalid_api_key",
            )
        scheme, _, secret = authorization.partition(" ")
        bearer, secret = scheme.lower() == "bearer", secret.strip()
        key = await self._lookup(secret) if bearer and secret.startswith(SECRET_PREFIX) else None
        if key is not None:
            return self._principal(key)
        if self.settings.server.allow_anonymous and bearer and not secret.startswith(SECRET_PREFIX):
            return self.anonymous()  # local development: SDKs insist on some key; a non-Sluice one is anonymous
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def _lookup(self, secret: str) -> ApiKey | None:
        if self.keys is None:
            return None
        try:
            return await self.keys.lookup(secret)
        except KeyStoreUnavailable as exc:
            raise service_unavailable("API keys cannot be checked right now. Retry later.", "auth_unavailable") from exc

    def _principal(self, key: ApiKey) -> Principal:
        cached = self._principals.get(key.id)
        if cached is not None and cached[0] is key:
            return cached[1]
        policy = effective_policy(self.settings, key.feature, key.policy)
        principal = Principal(key_id=key.id, tenant=key.tenant, feature=key.feature, policy=policy)
        self._principals[key.id] = (key, principal)
        return principal

    def anonymous(self) -> Principal:
        server = self.settings.server
        policy = self.settings.policy_for(server.anonymous_feature)
        return Principal(key_id=None, tenant=server.anonymous_tenant, feature=server.anonymous_feature, policy=policy)
