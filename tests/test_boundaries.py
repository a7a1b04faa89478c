"""Package boundaries, checked on the source (an import-linter-style contract, with `ast`).

Dependencies point one way: gateway → router → contract (`engines.api`) ← engines → kernels. The
gateway's request path speaks only the contract; engines are built only where the app is assembled;
nothing outside the gateway (its tests, benchmarks and migrations aside) imports it; no module takes
another package's `_private` names. And the request path stays made of small functions.
"""

from __future__ import annotations

import ast
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "router", "engines", "kernels", "bench", "migrations")
# Where the gateway constructs engines: the app's assembly and the CLI (router_cli: `sluice router label`).
GATEWAY_ASSEMBLY = {"gateway.assembly", "gateway.cli", "gateway.router_cli"}
REQUEST_PATH = [
    "engines/api",
    "gateway/auth.py",
    "gateway/budgets.py",
    "gateway/charges.py",
    "gateway/controllers/http.py",
    "gateway/controllers/openai.py",
    "gateway/cost.py",
    "gateway/counters.py",
    "gateway/fallback.py",
    "gateway/keys.py",
    "gateway/metrics.py",
    "gateway/pipeline.py",
    "gateway/redis_client.py",
    "gateway/relay.py",
    "gateway/slo.py",
    "router/decision.py",
]
MAX_FUNCTION_LINES = 40
MAX_MEDIAN_FUNCTION_LINES = 8


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(*packages: str) -> Iterator[tuple[str, ast.Module]]:
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield module_name(path), ast.parse(path.read_text(), str(path))


def imports(name: str, tree: ast.Module) -> Iterator[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import, those inside functions too."""
    package = name if (ROOT / name.replace(".", "/")).is_dir() else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = f"{base}.{node.module}" if node.level and node.module else base if node.level else node.module
            yield target or "", [alias.name for alias in node.names]


def top(module: str) -> str:
    return module.split(".")[0]


def violations(packages: tuple[str, ...], rule: object) -> list[str]:
    found = []
    for name, tree in modules(*packages):
        for target, _ in imports(name, tree):
            if not rule(name, target):  # type: ignore[operator]
                found.append(f"{name} imports {target}")
    return found


def test_the_gateway_speaks_only_the_contract_to_engines_outside_its_assembly() -> None:
    def allowed(name: str, target: str) -> bool:
        if name in GATEWAY_ASSEMBLY or top(target) != "engines":
            return True
        return target == "engines.api" or target.startswith("engines.api.")

    assert violations(("gateway",), allowed) == []


def test_engines_never_import_the_gateway_or_the_router() -> None:
    assert violations(("engines", "kernels"), lambda _, target: top(target) not in ("gateway", "router")) == []


def test_the_contract_depends_on_nothing_else_of_the_engines() -> None:
    def allowed(name: str, target: str) -> bool:
        return not name.startswith("engines.api") or top(target) != "engines" or target.startswith("engines.api")

    assert violations(("engines",), allowed) == []


def test_nothing_but_the_gateway_its_tests_benchmarks_and_migrations_imports_the_gateway() -> None:
    assert violations(("router", "engines", "kernels"), lambda _, target: top(target) != "gateway") == []


def test_kernels_import_only_torch_triton_and_the_standard_library() -> None:
    own = {"gateway", "router", "engines", "bench"}
    assert violations(("kernels",), lambda _, target: top(target) not in own) == []


def test_no_module_takes_another_packages_private_names() -> None:
    found = []
    for name, tree in modules(*PACKAGES, "tests"):
        for target, names in imports(name, tree):
            if top(target) in PACKAGES and top(target) != top(name):
                found += [f"{name} takes {target}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
    assert found == []


def test_the_contract_and_the_gateway_load_without_torch() -> None:
    code = "import sys, engines.api.client, engines.api.sse, gateway.app; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def request_path_functions() -> list[tuple[int, str]]:
    paths: list[Path] = []
    for entry in REQUEST_PATH:
        path = ROOT / entry
        paths += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    sizes = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                sizes.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(ROOT)}:{node.name}"))
    return sizes


def test_request_path_functions_are_short() -> None:
    sizes = request_path_functions()
    assert [where for lines, where in sizes if lines > MAX_FUNCTION_LINES] == []
    assert statistics.median(lines for lines, _ in sizes) <= MAX_MEDIAN_FUNCTION_LINES


@pytest.mark.parametrize("entry", REQUEST_PATH)
def test_the_request_path_list_names_files_that_exist(entry: str) -> None:
    assert (ROOT / entry).exists()
