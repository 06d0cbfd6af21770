"""The package layout is the architecture: read from the code's own imports (``ast``, every
``import`` and ``from ... import`` anywhere in a module, type-checking blocks and function-local
imports included), there is no import circle between files, and every import between the rooms
of ``bootstrap/``, and between the rooms inside ``bootstrap/engine/``, goes down its table below.
Run alone: ``python -m pytest tests/unit/test_layout.py``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "bootstrap"

# Room -> the rooms it may import. Top to bottom: entry points, the Python API, the LLM stages,
# the backends, the engine and the ranks, the domain, the generic stage runner, the leaves.
ALLOWED: dict[str, set[str]] = {
    "__main__": {"cli"},  # ``python -m bootstrap``, as ``torchrun -m bootstrap run`` starts it
    "cli": {
        "serve",
        "api",
        "stages",
        "backends",
        "engine",
        "parallel",
        "capacity",
        "pipeline",
        "config",
        "paths",
        "devices",
    },
    "serve": {"api", "stages", "backends", "engine", "pipeline", "config"},
    "api": {"stages", "backends", "engine", "pipeline", "config"},
    "stages": {"backends", "capacity", "pipeline", "config", "paths", "devices"},
    "backends": {"engine", "parallel", "capacity", "pipeline", "config", "devices"},
    "engine": {"capacity", "config", "paths", "devices"},  # never the stage runner: the engine runs without it
    "parallel": {"pipeline"},  # the torch.distributed side of the runner's Collective port
    "capacity": {"config"},  # pure: shapes from config.json, KV cost, the memory rule, the plan
    "pipeline": {"config", "paths", "devices"},  # generic: knows stages and attempts, nothing of LLMs
    "paths": {"config"},  # file-system checks: a directory made, a regular file opened, a mode in words
    "config": set(),
    "devices": set(),
}

# Inside the engine, the same rule one floor down: room -> the engine rooms it may import (each
# may also import what ``engine`` may, above). From the request API down to the kernels.
ENGINE_ALLOWED: dict[str, set[str]] = {
    "executor": {"spec", "scheduler", "step", "request", "sampling", "kv_cache"},  # the request API and its loop
    "spec": {"step", "request", "sampling", "kv_cache"},  # speculative decoding: draft passes, verify, depth
    "scheduler": {"step", "request", "kv_cache"},  # admission and the tokens of each step
    "step": {"models", "layers", "kernels", "request", "kv_cache"},  # one forward: inputs, graphs, runner
    "sources": {"models", "layers", "tokenizer"},  # where weights come from: checkpoints, GGUF, random
    "models": {"layers", "kernels"},  # the six families' own model code
    "layers": {"kernels", "kv_cache"},  # norms, rotary, linear, paged attention
    "request": {"sampling"},  # one request's state: sequence, timing, prompt rules
    "sampling": set(),  # sampling parameters, the batched sampler, logits processing
    "kernels": set(),  # Triton kernels and their compilation in the background
    "kv_cache": set(),  # the paged pool
    "tokenizer": set(),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The ``bootstrap`` modules ``path`` imports (``from pkg import submodule`` counts as the
    submodule; ``from pkg import name`` as the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])]
                )
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {owner(target, known) for target in found if target.startswith("bootstrap")} - {name}


def owner(target: str, known: dict[str, Path]) -> str:
    while target not in known:
        target = target.rpartition(".")[0]
    return target


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def room(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_between_files():
    assert circles(import_graph()) == []


def test_every_import_between_rooms_goes_down_the_table():
    upward = defaultdict(set)
    for module, targets in import_graph().items():
        for target in targets:
            here, there = room(module), room(target)
            if here and here != there and there not in ALLOWED[here]:
                upward[module].add(target)
    assert dict(upward) == {}


def test_the_table_itself_has_no_circle_and_names_every_room():
    assert circles({r: set(targets) for r, targets in ALLOWED.items()}) == []
    rooms = {p.stem for p in PACKAGE.iterdir() if p.name not in ("__init__.py", "__pycache__")}
    assert rooms == set(ALLOWED)


def test_top_level_holds_at_most_twelve_entries():
    """Rooms and top-level modules; the package's own ``__init__`` and ``__main__`` are not counted."""
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name not in ("__pycache__", "__init__.py", "__main__.py"))
    assert len(entries) <= 12, entries


def engine_room(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "engine" else ""


def test_every_import_between_engine_rooms_goes_down_the_engine_table():
    upward = defaultdict(set)
    for module, targets in import_graph().items():
        for target in targets:
            here, there = engine_room(module), engine_room(target)
            if here and there and here != there and there not in ENGINE_ALLOWED[here]:
                upward[module].add(target)
    assert dict(upward) == {}


def test_the_engine_table_has_no_circle_and_names_every_engine_room():
    assert circles({r: set(targets) for r, targets in ENGINE_ALLOWED.items()}) == []
    engine = PACKAGE / "engine"
    rooms = {p.stem for p in engine.iterdir() if p.name not in ("__init__.py", "__pycache__")}
    assert rooms == set(ENGINE_ALLOWED)
    assert len(rooms) <= 12, sorted(rooms)


# File names that more than one module carries, each for one thing seen from two rooms.
SHARED_NAMES = {
    "__init__": "every package",
    "__main__": "python -m bootstrap, and python -m bootstrap.cli: the same command",
    "errors": "each package's own exceptions (capacity's CapacityError, the server's HTTP errors)",
    "plan": "the capacity plan, and the command that prints it (cli/plan.py)",
    "probe": "the probe pool: its size (capacity), and TensorRT-LLM's own probe build (backends/trtllm)",
    "capacity": "the capacity math, and the stage that calls it (stages/capacity.py, stage ids name stage modules)",
    "serve": "the server package, and the command that starts it (cli/serve.py)",
    "backend": "each backend's class: backends/native, backends/sim, backends/trtllm",
    "routes": "each group of the server's routes: serve/openai, serve/startup, serve/status",
    "metrics": "the server's Prometheus metrics, and speculation's acceptance counts (engine/spec)",
}


def test_no_two_modules_share_a_name_for_different_things():
    stems: dict[str, list[str]] = defaultdict(list)
    for name in modules():
        stems[name.rpartition(".")[2]].append(name)
    shared = {stem: sorted(names) for stem, names in stems.items() if len(names) > 1 and stem not in SHARED_NAMES}
    assert shared == {}


@pytest.mark.parametrize("module", ["bootstrap.engine.executor.py_executor", "bootstrap.backends.native.backend"])
def test_the_checker_sees_real_imports(module):
    """Break-check of the parser: modules known to import others are seen doing so."""
    assert import_graph()[module]
