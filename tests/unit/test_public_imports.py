"""The public names resolve wherever their modules moved: the package's and the engine's lazy
exports, and the console script's entry point."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

import pytest

import bootstrap
import bootstrap.engine


@pytest.mark.parametrize(
    ("package", "name"),
    [(bootstrap, n) for n in bootstrap.__all__] + [(bootstrap.engine, n) for n in bootstrap.engine.__all__],
)
def test_every_lazy_export_resolves(package, name):
    value = getattr(package, name)  # AttributeError or ModuleNotFoundError when a path went stale
    assert getattr(value, "__name__", name) == name


def test_the_names_users_import_are_the_engine_classes():
    from bootstrap.engine.sampling.sampler import SamplingParams

    assert bootstrap.engine.SamplingParams is SamplingParams
    assert bootstrap.BootstrapConfig(model="random:tiny-llama", device="cpu").device == "cpu"


def test_the_console_script_points_at_a_callable():
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "bootstrap"]
    module, _, attr = script.value.partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
