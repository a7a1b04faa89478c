"""`/admin` over HTTP: nothing without credentials (every route walked), the admin key as Bearer or as a
signed HttpOnly SameSite=Strict session cookie, CSRF-safe writes, the API's numbers, key management,
and prompt text only for features that log content. Postgres and SQLite."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import msgspec
import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient

from gateway.admin import auth, queries
from gateway.admin.queries import Scope
from gateway.app import create_app
from gateway.config import PolicyConfig, Settings
from gateway.db.database import make_database
from gateway.db.migrate import upgrade_async
from gateway.keys import list_keys
from tests.conftest import _new_postgres_database
from tests.dashboard_data import Seeded, seed
from tests.gateway.conftest import ADMIN_KEY, make_settings
from tests.gateway.scripted_tier import ScriptedTier

BASE = "http://admin.test"
BEARER = {"authorization": f"Bearer {ADMIN_KEY}"}
SAME_ORIGIN = {"origin": BASE}
PANELS = ("escalation", "cost", "cache", "latency", "quality", "keys", "errors", "filters")


@pytest.fixture(scope="module", params=["postgres", "sqlite"])
async def seeded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple]:
    async def seeded_at(url: str) -> Seeded:
        engine = make_database(url)
        try:
            return await seed(engine, make_settings(database_url=url), end=datetime.now(UTC), count=1500)
        finally:
            await engine.dispose()

    if request.param == "postgres":
        async with _new_postgres_database(migrated=True) as url:
            yield url, await seeded_at(url)
    else:
        url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('dash-http') / 'sluice.db'}"
        await upgrade_async(url)
        yield url, await seeded_at(url)


def app_for(settings: Settings) -> Litestar:
    return create_app(settings, {"small": ScriptedTier("small"), "large": ScriptedTier("large")})


async def signed_in(client: AsyncTestClient) -> str:
    """Sign in through the form; returns the CSRF token of the page."""
    response = await client.post(
        "/admin/login", data={"admin_key": ADMIN_KEY, "next": "/admin"}, headers=SAME_ORIGIN, follow_redirects=False
    )
    assert response.status_code == 303 and response.headers["location"] == "/admin"
    page = (await client.get("/admin/")).text
    return re.search(r'name="csrf" value="([^"]+)"', page).group(1)


def admin_routes(app: Litestar) -> list[tuple[str, str]]:
    """Every (method, path) the app serves under /admin, path parameters filled in."""
    found = []
    for route in app.routes:
        if not route.path.startswith("/admin"):
            continue
        path = re.sub(r"\{file_path:path\}", "uPlot.min.css", route.path)
        path = re.sub(r"\{[^}]+\}", "some-id", path)
        for method in sorted(getattr(route, "methods", {"GET"}) - {"OPTIONS", "HEAD"}):
            found.append((method, path))
    return found


async def test_every_admin_route_refuses_a_request_without_credentials(seeded: tuple) -> None:
    url, _ = seeded
    app = app_for(make_settings(database_url=url))
    routes = admin_routes(app)
    assert {("GET", "/admin"), ("GET", "/admin/api/escalation"), ("POST", "/admin/forms/keys")} <= set(routes)
    assert any(path.startswith("/admin/static/") for _, path in routes)
    async with AsyncTestClient(app, base_url=BASE) as client:
        for method, path in routes:
            if path == "/admin/login":
                continue  # the sign-in form itself
            for headers in ({}, {"authorization": "Bearer wrong"}, {"cookie": f"{auth.SESSION_COOKIE}=forged.x.y"}):
                response = await client.request(method, path, headers=headers, follow_redirects=False)
                if response.status_code == 303:
                    assert response.headers["location"].startswith("/admin/login?next="), (method, path)
                else:
                    assert response.status_code == 401, (method, path, headers, response.status_code)
                    assert response.json()["error"]["code"] == "invalid_api_key"


async def test_the_admin_key_as_bearer_token_reads_the_api(seeded: tuple) -> None:
    url, _ = seeded
    async with AsyncTestClient(app_for(make_settings(database_url=url)), base_url=BASE) as client:
        for panel in PANELS:
            response = await client.get(f"/admin/api/{panel}", params={"range": "30d"}, headers=BEARER)
            assert response.status_code == 200, (panel, response.text)


async def test_the_api_reports_the_seeded_figures(seeded: tuple) -> None:
    url, data = seeded
    settings = make_settings(database_url=url)
    engine = make_database(url)
    async with AsyncTestClient(app_for(settings), base_url=BASE) as client:
        response = await client.get("/admin/api/escalation", params={"range": "30d"}, headers=BEARER)
        escalation = response.json()
        # Independently: escalations / routed requests per feature, from the seeded records.
        scope = Scope.last(timedelta(days=30))
        routed, escalated = defaultdict(int), defaultdict(int)
        for r in data.records:
            if scope.start <= r.created_at < scope.end and r.tier is not None:
                routed[r.feature] += 1
                escalated[r.feature] += r.escalated
        assert {f["feature"]: f["escalation_rate"] for f in escalation["features"]} == pytest.approx(
            {feature: escalated[feature] / routed[feature] for feature in routed}
        )
        # Every panel answers exactly what the query module computes for the same scope.
        expected = {
            "cost": await queries.cost(engine, scope, settings),
            "cache": await queries.cache(engine, scope),
            "latency": await queries.latency(engine, scope, settings),
            "errors": await queries.errors(engine, scope),
            "filters": await queries.choices(engine, scope),
        }
        for panel, figures in expected.items():
            response = await client.get(f"/admin/api/{panel}", params={"range": "30d"}, headers=BEARER)
            assert response.json() == msgspec.json.decode(msgspec.json.encode(figures)), panel
        filtered = await client.get(
            "/admin/api/cost",
            params={"start": scope.start.isoformat(), "end": scope.end.isoformat(), "feature": "search"},
            headers=BEARER,
        )
        assert [s["name"] for s in filtered.json()["series"]] == ["search"]
    await engine.dispose()


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"range": "1y"}, "range"),
        ({"start": "2026-01-01T00:00:00Z"}, "start"),
        ({"start": "2026-01-02T00:00:00Z", "end": "2026-01-01T00:00:00Z"}, "end"),
    ],
)
async def test_a_bad_range_is_a_clear_400(seeded: tuple, params: dict[str, str], param: str) -> None:
    url, _ = seeded
    async with AsyncTestClient(app_for(make_settings(database_url=url)), base_url=BASE) as client:
        response = await client.get("/admin/api/cost", params=params, headers=BEARER)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


async def test_signing_in_sets_a_signed_http_only_same_site_strict_cookie(seeded: tuple) -> None:
    url, _ = seeded
    async with AsyncTestClient(app_for(make_settings(database_url=url)), base_url=BASE) as client:
        wrong = await client.post("/admin/login", data={"admin_key": "nope"}, headers=SAME_ORIGIN)
        assert wrong.status_code == 401 and "not the admin key" in wrong.text
        cross_site = await client.post(
            "/admin/login", data={"admin_key": ADMIN_KEY}, headers={"origin": "https://evil.example"}
        )
        assert cross_site.status_code == 403 and auth.SESSION_COOKIE not in client.cookies
        response = await client.post(
            "/admin/login",
            data={"admin_key": ADMIN_KEY, "next": "//evil.example/x"},
            headers=SAME_ORIGIN,
            follow_redirects=False,
        )
        assert response.headers["location"] == "/admin"  # no redirect off this site
        cookie = response.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/admin" in cookie
        assert (await client.get("/admin/api/cache")).status_code == 200
        await client.post("/admin/logout", data={"csrf": await signed_in(client)}, headers=SAME_ORIGIN)
        assert (await client.get("/admin/api/cache")).status_code == 401


def test_a_session_is_bound_to_the_admin_key_and_expires() -> None:
    session = auth.new_session("key-one")
    assert auth.session_valid("key-one", session)
    assert not auth.session_valid("key-two", session)  # changing the admin key ends every session
    assert not auth.session_valid("key-one", session, now=datetime.now(UTC).timestamp() + auth.SESSION_TTL_S + 1)
    expiry, nonce, mac = session.split(".")
    assert not auth.session_valid("key-one", f"{int(expiry) + 3600}.{nonce}.{mac}")  # tampered expiry


async def test_writes_with_the_cookie_need_the_csrf_token_and_the_same_origin(seeded: tuple) -> None:
    url, data = seeded
    async with AsyncTestClient(app_for(make_settings(database_url=url)), base_url=BASE) as client:
        csrf = await signed_in(client)
        key = data.keys[0]
        revoke = f"/admin/forms/keys/{key.id}/revoke"
        assert (await client.post(revoke, data={}, headers=SAME_ORIGIN)).status_code == 403
        assert (await client.post(revoke, data={"csrf": "forged"}, headers=SAME_ORIGIN)).status_code == 403
        foreign = {"origin": "https://evil.example"}
        assert (await client.post(revoke, data={"csrf": csrf}, headers=foreign)).status_code == 403
        assert (await client.post(revoke, data={"csrf": csrf})).status_code == 403  # neither Origin nor Referer
        engine = make_database(url)
        assert key.id in {k.id for k in await list_keys(engine, include_revoked=False)}
        done = await client.post(revoke, data={"csrf": csrf}, headers=SAME_ORIGIN, follow_redirects=False)
        assert done.status_code == 303
        assert key.id not in {k.id for k in await list_keys(engine, include_revoked=False)}
        await engine.dispose()


async def test_keys_are_created_and_their_limits_edited_from_the_page(seeded: tuple) -> None:
    url, _ = seeded
    async with AsyncTestClient(app_for(make_settings(database_url=url)), base_url=BASE) as client:
        csrf = await signed_in(client)
        form = {"csrf": csrf, "tenant": "initech", "feature": "tps", "name": "reports", "rpm": "60", "tpm": ""}
        created = await client.post("/admin/forms/keys", data=form, headers=SAME_ORIGIN)
        assert created.status_code == 201
        secret = re.search(r'id="new-secret">([^<]+)<', created.text).group(1)
        assert secret.startswith("sk-sluice-")
        engine = make_database(url)
        (key,) = [k for k in await list_keys(engine, tenant="initech")]
        assert key.policy == {"rpm": 60}
        limits = {"csrf": csrf, "rpm": "", "tpm": "1000", "spend_per_day_usd": "2.5"}
        saved = await client.post(f"/admin/forms/keys/{key.id}/limits", data=limits, headers=SAME_ORIGIN)
        assert saved.status_code == 200 and "Limits saved." in saved.text
        (key,) = await list_keys(engine, tenant="initech")
        assert key.policy == {"tpm": 1000, "spend_per_day_usd": 2.5}  # an empty field removes the override
        bad = await client.post(
            f"/admin/forms/keys/{key.id}/limits", data=limits | {"rpm": "lots"}, headers=SAME_ORIGIN
        )
        assert bad.status_code == 400 and "rpm must be a number" in bad.text
        # The admin API (Bearer) edits the same overrides.
        patched = await client.patch(f"/admin/keys/{key.id}", json={"policy": {"tpm": None, "rpm": 5}}, headers=BEARER)
        assert patched.status_code == 200 and patched.json()["policy"] == {"spend_per_day_usd": 2.5, "rpm": 5}
        missing = await client.patch("/admin/keys/none", json={"policy": {"rpm": 5}}, headers=BEARER)
        assert missing.status_code == 404
        await engine.dispose()


async def test_prompt_text_appears_only_for_features_that_log_content(seeded: tuple) -> None:
    url, _ = seeded
    quiet = make_settings(database_url=url)
    logged = msgspec.structs.replace(
        quiet, policies={"default": PolicyConfig(), "code-review": PolicyConfig(log_content=True)}
    )
    for settings, shown in ((quiet, False), (logged, True)):
        async with AsyncTestClient(app_for(settings), base_url=BASE) as client:
            await signed_in(client)
            page = (await client.get("/admin/", params={"range": "30d"})).text
            api = (await client.get("/admin/api/quality", params={"range": "30d"}, headers=BEARER)).text
            assert ("prompt of " in page, "prompt of " in api) == (shown, shown)


async def test_without_an_admin_key_the_dashboard_is_disabled(seeded: tuple) -> None:
    url, _ = seeded
    settings = make_settings(database_url=url)
    settings = msgspec.structs.replace(settings, server=msgspec.structs.replace(settings.server, admin_key=""))
    async with AsyncTestClient(app_for(settings), base_url=BASE) as client:
        assert (await client.get("/admin/login")).status_code == 403
        assert (await client.get("/admin/api/cost", headers={"authorization": "Bearer "})).status_code == 403
        login = await client.post("/admin/login", data={"admin_key": ""}, headers=SAME_ORIGIN)
        assert login.status_code == 403
