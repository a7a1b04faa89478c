"""docker-compose.yml and the Dockerfile agree with the code (Docker itself cannot run here).

Every `SLUICE_*` variable the compose file sets must load through `load_settings`, the gateway's
tiers must point at the engine services, and every `sluice ...` command a service runs must be one
the CLI accepts.
"""

from __future__ import annotations

import importlib
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
SLUICE_SERVICES = [name for name, service in SERVICES.items() if service.get("image") == "sluice:latest"]
_VARIABLE = re.compile(r"\$\{(?P<name>\w+)(?::?[-?](?P<default>[^}]*))?\}")


def interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` / `${VAR:?message}` with every variable unset (defaults, or a stand-in)."""
    return _VARIABLE.sub(
        lambda m: m.group("default") if "-" in m.group(0) else f"test-{m.group('name').lower()}", value
    )


def environment(service: str) -> dict[str, str]:
    return {k: interpolate(str(v)) for k, v in (SERVICES[service].get("environment") or {}).items()}


def test_runs_the_production_shape() -> None:
    assert {"postgres", "redis", "engine-small", "engine-large", "gateway", "loadbalancer"} <= set(SERVICES)
    assert int(interpolate(str(SERVICES["gateway"]["deploy"]["replicas"]))) >= 2
    assert SERVICES["loadbalancer"]["ports"] == ["8000:8000"]
    assert "server gateway:8000" in COMPOSE["configs"]["nginx-conf"]["content"]


@pytest.mark.parametrize("service", SLUICE_SERVICES)
def test_every_sluice_variable_loads_into_the_settings(
    service: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no sluice.toml from the working directory
    env = environment(service)
    assert all(name.startswith("SLUICE_") for name in env)
    settings = load_settings(environ=env)
    if "SLUICE_DATABASE__URL" in env:
        assert settings.database.url == env["SLUICE_DATABASE__URL"]


def test_gateway_tiers_point_at_the_engine_services_and_postgres_and_redis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    settings = load_settings(environ=environment("gateway"))
    for tier in ("small", "large"):
        url = urlsplit(settings.tiers[tier].url)
        engine = SERVICES[f"engine-{tier}"]
        assert url.hostname == f"engine-{tier}"
        assert engine["command"][engine["command"].index("--port") + 1] == str(url.port)
        assert engine["command"][engine["command"].index("--tier") + 1] == tier
    database = urlsplit(settings.database.url)
    postgres = SERVICES["postgres"]["environment"]
    assert (database.hostname, database.username, database.path) == (
        "postgres",
        postgres["POSTGRES_USER"],
        f"/{postgres['POSTGRES_DB']}",
    )
    assert urlsplit(settings.redis.url).hostname == "redis"
    assert environment("migrate")["SLUICE_DATABASE__URL"] == settings.database.url


def test_gateways_start_after_migrations_and_engines_after_the_model_fetch() -> None:
    assert SERVICES["migrate"]["command"][:2] == ["db", "upgrade"]
    assert SERVICES["gateway"]["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    assert SERVICES["models"]["command"][:2] == ["models", "fetch"]
    for tier in ("small", "large"):
        assert SERVICES[f"engine-{tier}"]["depends_on"]["models"] == {"condition": "service_completed_successfully"}


@pytest.mark.parametrize("service", SLUICE_SERVICES)
def test_every_service_command_is_one_the_cli_accepts(service: str) -> None:
    entry_point = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["sluice"]
    module_name, _, _function = entry_point.partition(":")
    try:
        cli = importlib.import_module(module_name)
    except ImportError as exc:
        pytest.fail(f"pyproject's `sluice = {entry_point!r}` cannot be imported ({exc}): the image has no CLI")
    cli.build_parser().parse_args(SERVICES[service]["command"])  # exits (fails the test) on unknown arguments


def test_the_image_holds_every_python_package_of_the_project() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in include} - {"tests"}
    for package in sorted(p for p in packages if (ROOT / p).is_dir()):
        assert f"COPY {package} ./{package}" in dockerfile, f"{package}/ is not copied into the image"
    assert "--index-url https://download.pytorch.org/whl/cpu" in dockerfile
    assert shlex.split(dockerfile.split("ENTRYPOINT", 1)[1].splitlines()[0].strip(" []").replace(",", " ")) == [
        "sluice"
    ]
