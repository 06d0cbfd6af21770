"""Shared by every test directory: ``tests/`` on the path for ``helpers`` (pytest's default import
mode does this for the directory of this file; said here so that any mode finds it), the
default model's fixture, and a home of the suite's own (``helpers.home``): HOME and
XDG_CACHE_HOME point into a temporary folder before anything is imported, so no test, nor any
process a test starts (they inherit the environment), reads or writes the user's real caches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from helpers import home  # noqa: E402

home.enter()  # before ``bootstrap`` is imported: its default cache paths are read from HOME

from helpers.smollm2 import smollm2_cache_dir  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_cache() -> Path:
    """The SmolLM2 checkpoint's cache directory (skips when offline and not cached)."""
    return smollm2_cache_dir()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--screenshots",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the browser tests save their screenshots (default: the test's tmp_path); "
        "docs/ holds the committed ones",
    )


@pytest.fixture
def screenshots(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """The folder the browser tests save screenshots in (``--screenshots``, else ``tmp_path``)."""
    folder = request.config.getoption("--screenshots") or tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def pytest_unconfigure(config: pytest.Config) -> None:
    home.leave()
