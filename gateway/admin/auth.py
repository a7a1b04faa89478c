"""Admin authentication for `/admin`: the configured `server.admin_key` as a Bearer token (API clients),
or a session cookie that the login form sets once the key was typed in (people).

The session is stateless and signed: `<expiry>.<nonce>.<HMAC>` under a key derived from the admin key,
so every replica accepts it without shared storage and changing the admin key ends every session.
Writes made with the cookie carry a CSRF token (an HMAC of the session, in a hidden form field or the
`x-csrf-token` header) and must come from the same origin; the cookie itself is HttpOnly and
SameSite=Strict, so other sites can neither read it nor send it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

SESSION_COOKIE = "sluice_admin"
SESSION_TTL_S = 12 * 3600
CSRF_FIELD = "csrf"
CSRF_HEADER = "x-csrf-token"


def _key(admin_key: str, purpose: bytes) -> bytes:
    return hmac.new(admin_key.encode(), b"sluice admin " + purpose, hashlib.sha256).digest()


def _mac(admin_key: str, purpose: bytes, message: str) -> str:
    digest = hmac.new(_key(admin_key, purpose), message.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def admin_key_matches(admin_key: str, candidate: str) -> bool:
    return bool(admin_key) and hmac.compare_digest(candidate.strip().encode(), admin_key.encode())


def bearer_matches(admin_key: str, authorization: str | None) -> bool:
    scheme, _, secret = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and admin_key_matches(admin_key, secret)


def new_session(admin_key: str, *, now: float | None = None) -> str:
    payload = f"{int((now or time.time()) + SESSION_TTL_S)}.{secrets.token_urlsafe(16)}"
    return f"{payload}.{_mac(admin_key, b'session', payload)}"


def session_valid(admin_key: str, token: str | None, *, now: float | None = None) -> bool:
    if not admin_key or not token or token.count(".") != 2:
        return False
    payload, _, mac = token.rpartition(".")
    if not hmac.compare_digest(mac.encode(), _mac(admin_key, b"session", payload).encode()):
        return False
    expiry = payload.partition(".")[0]
    return expiry.isdigit() and int(expiry) > (now or time.time())


def csrf_token(admin_key: str, session: str) -> str:
    return _mac(admin_key, b"csrf", session)


def csrf_valid(admin_key: str, session: str, submitted: str | None) -> bool:
    return bool(submitted) and hmac.compare_digest(submitted.encode(), csrf_token(admin_key, session).encode())


def same_origin(headers: Mapping[str, str]) -> bool:
    """The request comes from a page of this server: its Origin (or, without one, its Referer) names
    the host it was sent to. Browsers send Origin with every form POST."""
    source = headers.get("origin") or headers.get("referer")
    if not source:
        return False
    return urlsplit(source).netloc == headers.get("host", "")
