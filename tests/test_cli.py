"""`sluice` is one command line with --help everywhere."""

import subprocess
import sys

import pytest

COMMANDS = [
    [],
    ["serve"],
    ["engine"],
    ["models"],
    ["models", "fetch"],
    ["models", "list"],
    ["db"],
    ["keys"],
    ["keys", "create"],
    ["keys", "list"],
    ["keys", "revoke"],
    ["bench"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "sluice")
def test_every_subcommand_has_help(command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", *command, "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: sluice")


def test_invalid_configuration_exits_with_the_key_named() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "models", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"SLUICE_SERVER__PORT": "eighty", "PATH": ""},
    )
    assert result.returncode == 2
    assert "server.port" in result.stderr
