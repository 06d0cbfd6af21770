"""A real headless Chromium for the status page tests, driven by Selenium: Debian's ``chromium``
and ``chromium-driver`` (``.ci/run`` installs them). When it cannot start, the test fails with
the reason: a browser test that did not run has not passed."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest

BINARIES = ("/usr/bin/chromium", "/usr/bin/chromedriver")  # Debian's packages
WAIT_S = 120.0


@contextlib.contextmanager
def chromium(width: int = 1100, height: int = 1300) -> Iterator[Any]:
    """A headless Chromium with its console log kept (``console_errors``); quit at the end."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:
        pytest.fail(f"the browser tests need selenium (the dev extra): {exc}")
    binary, driver = (shutil.which(name) or path for name, path in zip(("chromium", "chromedriver"), BINARIES))
    options = webdriver.ChromeOptions()
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
        "--disable-extensions",
        "--no-first-run",
    ):
        options.add_argument(flag)
    options.binary_location = binary
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        browser = webdriver.Chrome(service=Service(driver), options=options)
    except Exception as exc:
        pytest.fail(
            f"headless Chromium cannot start ({binary}, {driver}): {type(exc).__name__}: {exc}; "
            "install Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
        )
    try:
        yield browser
    finally:
        browser.quit()


def console_errors(browser: Any) -> list[dict[str, Any]]:
    """The console's errors so far (level SEVERE: uncaught exceptions, failed loads)."""
    return [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


def wait_for(browser: Any, check: Callable[[Any], Any], what: str, timeout: float = WAIT_S) -> Any:
    """``check(browser)`` once it is truthy; fails naming ``what`` and the page's phase otherwise."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(browser, timeout, poll_frequency=0.05).until(check)
    except TimeoutException:
        phase = browser.execute_script("return document.getElementById('phase')?.textContent")
        pytest.fail(
            f"the page never showed {what} within {timeout:g} s (phase: {phase}); console: {console_errors(browser)}"
        )
