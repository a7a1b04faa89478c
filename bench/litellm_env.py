"""LiteLLM proxy as the benchmark's reference gateway, in a throwaway venv cached between runs.

It lives outside the project's venv so that LiteLLM's large dependency tree never meets ours.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

LITELLM_VERSION = "1.106.12"
VENV_DIR = Path("~/.cache/sluice/bench/litellm-venv").expanduser()
# The same event loop and HTTP parser as Sluice's uvicorn, so the comparison is between the gateways.
SERVER_EXTRAS = ("uvloop==0.23.0", "httptools==0.9.0")
MASTER_KEY = "sk-bench-litellm-master"
_INSTALLED_MARKER = ".sluice-installed"


def ensure_venv(venv_dir: Path = VENV_DIR, version: str = LITELLM_VERSION) -> Path:
    """Install `litellm[proxy]==version` (and the server extras) into the venv unless already done;
    returns the venv's `litellm` command. A different version or extras rebuilds the venv."""
    litellm_bin = venv_dir / "bin" / "litellm"
    marker = venv_dir / _INSTALLED_MARKER
    requirements = [f"litellm[proxy]=={version}", *SERVER_EXTRAS]
    if marker.exists() and marker.read_text().split() == requirements and litellm_bin.exists():
        return litellm_bin
    print(f"installing {' '.join(requirements)} into {venv_dir} (once; cached for reruns)", file=sys.stderr)
    venv.EnvBuilder(with_pip=True, clear=True).create(venv_dir)
    pip = [str(venv_dir / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, *requirements], check=True)
    marker.write_text("\n".join(requirements) + "\n")
    return litellm_bin


def write_config(path: Path, upstream_url: str, model_names: list[str]) -> Path:
    """A minimal proxy config: each model name forwarded to the OpenAI-compatible upstream, no database,
    a static master key so that requests are authenticated as they are through Sluice."""
    lines = ["model_list:"]
    for name in model_names:
        lines += [
            f"  - model_name: {name}",
            "    litellm_params:",
            f"      model: openai/{name}",
            f"      api_base: {upstream_url}/v1",
            "      api_key: sk-upstream",
        ]
    lines += [
        "litellm_settings:",
        "  set_verbose: false",
        "  telemetry: false",
        "  drop_params: true",
        "general_settings:",
        f"  master_key: {MASTER_KEY}",
        "  disable_spend_logs: true",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def proxy_command(litellm_bin: Path, config: Path, port: int) -> list[str]:
    return [str(litellm_bin), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]


def proxy_environment() -> dict[str, str]:
    """Keep the proxy off the network (no cost-map download, no telemetry) and quiet."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env.update(
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        LITELLM_TELEMETRY="False",
        LITELLM_LOG="ERROR",
        DISABLE_ADMIN_UI="True",
        LITELLM_MODE="PRODUCTION",
    )
    env.pop("DATABASE_URL", None)
    return env


if __name__ == "__main__":
    print(ensure_venv())
