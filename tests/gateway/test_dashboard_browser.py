"""The dashboard in a real browser (Debian's Chromium driven by Playwright): sign in, see the charts drawn
from seeded traffic, change the range and the feature filter, revoke a key. The page is saved as
tests/artifacts/dashboard.png."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
import uvicorn

from gateway.app import create_app
from gateway.db.database import make_database
from gateway.db.migrate import upgrade_async
from gateway.db.schema import api_keys
from tests.dashboard_data import seed
from tests.gateway.conftest import ADMIN_KEY, make_settings
from tests.gateway.scripted_tier import ScriptedTier

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CHARTS = ("chart-escalation", "chart-cost", "chart-cache", "chart-ttft", "chart-itl")

pytestmark = pytest.mark.timeout(120)


def ensure_chromium() -> Path:
    """Debian's Chromium; installed here when absent (a fresh CI machine), as `make browser` does."""
    if not CHROMIUM.exists() and shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-q"], check=False, env=env, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], check=False, env=env, capture_output=True)
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make browser` (apt-get install -y chromium) as root.", pytrace=False)
    return CHROMIUM


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def dashboard_url(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A gateway on a real port over an SQLite file holding 30 days of seeded traffic."""
    database = f"sqlite+aiosqlite:///{tmp_path / 'sluice.db'}"
    settings = make_settings(database_url=database)

    async def prepare() -> None:
        await upgrade_async(database)
        engine = make_database(database)
        await seed(engine, settings, end=datetime.now(UTC))
        await engine.dispose()

    asyncio.run(prepare())
    app = create_app(settings, {"small": ScriptedTier("small"), "large": ScriptedTier("large")})
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the gateway did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", database
    server.should_exit = True
    thread.join(10)


async def _revoked_ids(database: str) -> set[str]:
    engine = make_database(database)
    try:
        async with engine.connect() as connection:
            query = sa.select(api_keys.c.id).where(api_keys.c.revoked_at.is_not(None))
            return set((await connection.execute(query)).scalars())
    finally:
        await engine.dispose()


def test_sign_in_read_the_charts_filter_and_revoke_a_key(dashboard_url: tuple[str, str]) -> None:
    from playwright.sync_api import expect, sync_playwright

    base, database = dashboard_url
    chromium = ensure_chromium()
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        page.set_default_timeout(15_000)

        page.goto(f"{base}/admin/?range=30d")
        expect(page).to_have_url(f"{base}/admin/login?next=%2Fadmin%3Frange%3D30d")  # not signed in: the form
        page.fill("#admin_key", "wrong")
        page.click("button[type=submit]")
        expect(page.get_by_role("alert")).to_contain_text("not the admin key")
        page.fill("#admin_key", ADMIN_KEY)
        page.click("button[type=submit]")
        expect(page).to_have_url(f"{base}/admin?range=30d")  # back where the browser was going
        # The headline answers the question: the seeded feature with the highest escalation odds leads.
        expect(page.locator("#answer")).to_contain_text("code-review escalates most")
        for chart in CHARTS:
            expect(page.locator(f"#{chart}")).to_have_attribute("data-drawn", "true")
            expect(page.locator(f"#{chart} canvas")).to_have_count(1)
        expect(page.locator("#chart-escalation .u-legend")).to_contain_text("support-chat")
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

        page.select_option("#range", "24h")
        expect(page).to_have_url(f"{base}/admin?range=24h&feature=&tenant=")
        expect(page.locator(".range-note")).to_contain_text("by hour")

        page.select_option("#feature", "search")
        expect(page).to_have_url(f"{base}/admin?range=24h&feature=search&tenant=")
        expect(page.locator("#features-table tbody tr")).to_have_count(1)
        expect(page.locator("#features-table tbody tr td").first).to_have_text("search")
        expect(page.locator("#keys-table tbody tr")).to_have_count(2)  # one key per tenant for this feature

        row = page.locator("#keys-table tbody tr").first
        key_id = row.get_attribute("data-key-id")
        page.once("dialog", lambda dialog: dialog.accept())
        row.locator("form.revoke button").click()
        expect(page.get_by_role("status")).to_contain_text("Key revoked.")
        expect(page.locator(f'#keys-table tr[data-key-id="{key_id}"]')).to_have_count(0)
        browser.close()
    assert asyncio.run(_revoked_ids(database)) == {key_id}
