"""The generic stage runner: it knows stages, attempts and artifacts, and nothing of LLMs.

``Pipeline`` runs ``Stage``s (functions whose parameter names are their inputs) in dependency
order (``dependencies``), each through ``attempts`` (its span, tenacity retries, rollback through
``undo``, adaptation), on one ``device_thread``, publishing ``events``; ``telemetry`` exports the
spans, ``report`` turns them into the stage table, ``collective`` agrees every attempt across
ranks. The LLM stages that run on it live in ``bootstrap.stages``.
"""

from bootstrap.pipeline.runner import Pipeline, PipelineClosed, StageFailed, failure_paragraph
from bootstrap.pipeline.stage import Adaptation, GiveUp, RetryPolicy, Skip, Stage

__all__ = [
    "Adaptation",
    "GiveUp",
    "Pipeline",
    "PipelineClosed",
    "RetryPolicy",
    "Skip",
    "Stage",
    "StageFailed",
    "failure_paragraph",
]
