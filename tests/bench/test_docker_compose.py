"""docker-compose.yml and the Dockerfile agree with the code (Docker itself cannot run here).

`docker compose up` must start with no environment at all: the file is interpolated from an empty
environment the way Compose does it (a `${VAR:?message}` is an error), then validated against the
official Compose Specification schema. Every `SLUICE_*` variable the compose file sets must load
through `load_settings`, the gateway's tiers must point at the engine services, every `sluice ...`
command a service runs must be one the CLI accepts, and the ports agree end to end.
"""

from __future__ import annotations

import importlib
import json
import os
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
# ../shared/data beside the repository; $SHARED_DATA names it elsewhere (a git worktree). Not SLUICE_*:
# every SLUICE_* variable is read as configuration.
SHARED_DATA = Path(os.environ.get("SHARED_DATA") or ROOT.parent / "shared" / "data")
COMPOSE_SPEC = SHARED_DATA / "compose" / "compose-spec.json"
RAW = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
LAPTOP_CORES, LAPTOP_MEMORY = 2, 16 << 30


class InterpolationError(ValueError):
    """A `${VAR:?message}` whose variable is unset: `docker compose up` stops with the message."""


def _interpolate_text(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation of one string: `$$`, `$VAR`, `${VAR}`, `${VAR:-default}`,
    `${VAR-default}`, `${VAR:?error}`, `${VAR?error}`, `${VAR:+alt}`, `${VAR+alt}`; defaults nest."""
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char != "$":
            out.append(char)
            i += 1
        elif text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("${", i):
            depth, j = 1, i + 2
            while depth:
                if j >= len(text):
                    raise InterpolationError(f"unterminated ${{ in {text!r}")
                depth += {"{": 1, "}": -1}.get(text[j], 0) if text[j - 1] == "$" or text[j] == "}" else 0
                j += 1
            out.append(_substitute(text[i + 2 : j - 1], env))
            i = j
        elif match := re.match(r"\$([A-Za-z_]\w*)", text[i:]):
            out.append(env.get(match.group(1), ""))
            i += match.end()
        else:
            raise InterpolationError(f"invalid interpolation format in {text!r}")
    return "".join(out)


def _substitute(expression: str, env: dict[str, str]) -> str:
    match = re.fullmatch(r"(?P<name>[A-Za-z_]\w*)(?:(?P<op>:?[-?+])(?P<arg>.*))?", expression, re.DOTALL)
    if match is None:
        raise InterpolationError(f"invalid interpolation ${{{expression}}}")
    name, op, arg = match.group("name"), match.group("op"), match.group("arg") or ""
    value = env.get(name)
    is_set, non_empty = value is not None, bool(value)
    present = non_empty if op and op.startswith(":") else is_set
    if op in ("-", ":-"):
        return value if present else _interpolate_text(arg, env)  # type: ignore[return-value]
    if op in ("?", ":?"):
        if not present:
            raise InterpolationError(f"required variable {name} is missing a value: {arg}")
        return value  # type: ignore[return-value]
    if op in ("+", ":+"):
        return _interpolate_text(arg, env) if present else ""
    return value or ""


def interpolate(node: Any, env: dict[str, str]) -> Any:
    """Every string value of the file, interpolated (keys are not, as in Compose)."""
    if isinstance(node, str):
        return _interpolate_text(node, env)
    if isinstance(node, dict):
        return {key: interpolate(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate(value, env) for value in node]
    return node


COMPOSE = interpolate(RAW, env={})
SERVICES: dict[str, Any] = COMPOSE["services"]
SLUICE_SERVICES = [name for name, service in SERVICES.items() if service.get("image") == "sluice:latest"]
NGINX = COMPOSE["configs"]["nginx-conf"]["content"]


def environment(service: str) -> dict[str, str]:
    return {k: str(v) for k, v in (SERVICES[service].get("environment") or {}).items()}


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def _bytes(size: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([kmg]?)b?", str(size).lower()).groups()  # type: ignore[union-attr]
    return int(number) << {"": 0, "k": 10, "m": 20, "g": 30}[unit]


def test_interpolation_follows_compose() -> None:
    env = {"SET": "x", "EMPTY": ""}
    cases = {
        "${SET}": "x", "$SET": "x", "${UNSET}": "", "$$SET": "$SET", "${UNSET:-d}": "d", "${EMPTY:-d}": "d",
        "${EMPTY-d}": "", "${UNSET-d}": "d", "${UNSET:-${SET}}": "x", "${SET:+alt}": "alt", "${UNSET:+alt}": "",
        "a${SET}b": "axb", "${EMPTY:?}": None, "${UNSET?oops}": None, "${EMPTY?fine}": "",
    }
    for text, expected in cases.items():
        if expected is None:
            with pytest.raises(InterpolationError):
                _interpolate_text(text, env)
        else:
            assert _interpolate_text(text, env) == expected, text


def test_the_file_needs_no_environment_and_matches_the_compose_specification() -> None:
    interpolate(RAW, env={})  # raises InterpolationError on any required variable
    if not COMPOSE_SPEC.is_file():
        pytest.skip(f"{COMPOSE_SPEC} is absent (the Compose Specification schema; see ../shared/data/README.md)")
    import jsonschema

    schema = json.loads(COMPOSE_SPEC.read_text())
    # The file names draft-07 without the trailing `#` that jsonschema keys its validators by.
    validator = jsonschema.Draft7Validator(schema, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(COMPOSE)]
    assert not errors, "\n".join(errors)


def test_fits_a_two_core_sixteen_gigabyte_laptop() -> None:
    memory = 0
    for name, service in SERVICES.items():
        limits = ((service.get("deploy") or {}).get("resources") or {}).get("limits") or {}
        # Docker refuses to start a container whose CPU limit exceeds the host's cores.
        assert float(limits.get("cpus", 0)) <= LAPTOP_CORES, f"{name}: cpus {limits['cpus']}"
        assert "cpus" not in service and "cpuset" not in service, name
        replicas = int((service.get("deploy") or {}).get("replicas", 1))
        memory += replicas * _bytes(limits["memory"]) if "memory" in limits else 0
    assert memory <= LAPTOP_MEMORY * 0.8, f"memory limits sum to {memory / 2**30:.1f} GiB"


def test_admin_is_disabled_not_required_and_never_routed_publicly() -> None:
    assert environment("gateway")["SLUICE_SERVER__ADMIN_KEY"] == ""
    assert re.search(r"location \^~ /admin \{[^}]*return 404", NGINX)


def test_nginx_keeps_the_client_request_id() -> None:
    mapping = re.search(r"map \$http_x_request_id \$(\w+) \{([^}]*)\}", NGINX)
    assert mapping is not None
    assert re.search(r"default\s+\$http_x_request_id;", mapping.group(2))
    assert re.search(r'""\s+\$request_id;', mapping.group(2))
    assert f"proxy_set_header X-Request-Id ${mapping.group(1)};" in NGINX


def test_accounting_spool_is_on_a_volume() -> None:
    spool = environment("gateway")["SLUICE_SERVER__SPOOL_DIR"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in SERVICES["gateway"]["volumes"]}
    assert mounts.get(spool) in COMPOSE["volumes"], f"{spool} is not a named volume: rows spooled there die with it"
    assert f"mkdir -p /models {spool}" in (ROOT / "Dockerfile").read_text()  # owned by the image's user


def test_ports_agree_from_load_balancer_to_engines() -> None:
    gateway_port = option(SERVICES["gateway"]["command"], "--port")
    published = SERVICES["loadbalancer"]["ports"][0].split(":")
    assert f"listen {published[-1]};" in NGINX
    assert f"server gateway:{gateway_port} resolve;" in NGINX
    exposed = re.search(r"^EXPOSE (.*)$", (ROOT / "Dockerfile").read_text(), re.M).group(1).split()  # type: ignore[union-attr]
    for tier in ("small", "large"):
        engine = SERVICES[f"engine-{tier}"]
        port = option(engine["command"], "--port")
        assert port in exposed and f"127.0.0.1:{port}/healthz" in " ".join(engine["healthcheck"]["test"])
    assert gateway_port in exposed


def test_runs_the_production_shape() -> None:
    assert {"postgres", "redis", "engine-small", "engine-large", "gateway", "loadbalancer"} <= set(SERVICES)
    assert int(SERVICES["gateway"]["deploy"]["replicas"]) >= 2
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
