"""The TensorRT-LLM backend: the same stages driving TensorRT-LLM's own ``PyExecutor``.

TensorRT-LLM is an optional extra (``pip install 'executor-bootstrap[trtllm]'``); nothing here
imports it at module import time. Every TensorRT-LLM name the adapter uses is listed, with its
parameters per supported version, in ``manifest.json``, and every call goes through the checking
layer in ``checked_api.py``. Layout:

  manifest.json, manifest.py   the names, as data; version profiles 1.2.1 and main
  checked_api.py               the checking layer (and the clear error when TRT is missing)
  llm_args.py                  TorchLlmArgs / KvCacheConfig from the config; per-attempt copies
  handles.py                   releasable holders for what stages hand on
  load.py, probe.py, final.py  the stages: engines, sampler; estimation, profiling; final managers, executor, smoke
  teardown.py                  rollback in the reference's teardown order
  backend.py                   TrtllmBackend, the Backend protocol
"""

from __future__ import annotations

from bootstrap.backends.trtllm.backend import TrtllmBackend
from bootstrap.devices import Device


def create_backend(device: Device) -> TrtllmBackend:
    """A backend on the installed TensorRT-LLM; ``MissingExtra`` names the install command if absent."""
    return TrtllmBackend(device)


__all__ = ["TrtllmBackend", "create_backend"]
