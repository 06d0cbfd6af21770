"""Stage graph checks and ordering, derived from what each stage needs and provides."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from graphlib import CycleError, TopologicalSorter
from typing import Any

from bootstrap.pipeline.stage import Stage, artifact_names


class GraphError(ValueError):
    """The stages do not form a valid graph (missing input, duplicate, cycle, bad consume)."""


def check_graph(stages: Sequence[Stage], inputs: Iterable[str]) -> None:
    given = set(inputs)
    _check_unique(stages, given)
    provided = given | {s.provides for s in stages}
    for stage in stages:
        missing = [n for n in stage.requires if n not in provided]
        if missing:
            raise GraphError(f"stage {stage.id!r} needs {missing}, which no stage or input provides")
        for name in stage.consumes:
            if name not in stage.requires:
                raise GraphError(f"stage {stage.id!r} consumes {name!r} without requiring it")
            others = [s.id for s in stages if s is not stage and name in s.requires]
            if others:
                raise GraphError(f"{name!r} is consumed by {stage.id!r} but also needed by {others}")
    topological_order(stages)


def check_after(stages: Sequence[Stage], after: Mapping[str, Callable[..., Any]]) -> None:
    """Every function to run after a stage follows a stage of the graph and names only what that
    stage had: its inputs and its artifact."""
    by_id = {s.id: s for s in stages}
    for stage_id, fn in after.items():
        if stage_id not in by_id:
            raise GraphError(f"a function runs after stage {stage_id!r}, which is not in the graph")
        stage = by_id[stage_id]
        unknown = [n for n in artifact_names(fn) if n not in (*stage.requires, stage.provides)]
        if unknown:
            raise GraphError(
                f"the function after stage {stage_id!r} needs {unknown}, neither its inputs nor its artifact"
            )


def _check_unique(stages: Sequence[Stage], given: set[str]) -> None:
    seen_ids: set[str] = set()
    seen_outputs: set[str] = set(given)
    for stage in stages:
        if stage.id in seen_ids:
            raise GraphError(f"duplicate stage id {stage.id!r}")
        if stage.provides in seen_outputs:
            raise GraphError(f"artifact {stage.provides!r} is provided twice (stage {stage.id!r})")
        seen_ids.add(stage.id)
        seen_outputs.add(stage.provides)


def topological_order(stages: Sequence[Stage]) -> list[Stage]:
    """Stages in dependency order; ties keep the order given."""
    producer = {s.provides: s.id for s in stages}
    sorter = TopologicalSorter({s.id: {producer[n] for n in s.requires if n in producer} for s in stages})
    try:
        sorter.prepare()
    except CycleError as exc:
        raise GraphError(f"stage graph has a cycle: {' -> '.join(exc.args[1])}") from None
    by_id = {s.id: s for s in stages}
    index = {s.id: i for i, s in enumerate(stages)}
    ordered: list[Stage] = []
    while sorter.is_active():
        ready = sorted(sorter.get_ready(), key=index.__getitem__)
        ordered.extend(by_id[i] for i in ready)
        sorter.done(*ready)
    return ordered
