"""Fake ``PyExecutor``, ``create_py_executor_instance``, requests and responses.

From py_executor.py and _util.py: ``create_py_executor_instance`` adds a ``SeqSlotManager`` to
the ``resources`` dict it is given (mutating it), builds the scheduler and the ``PyExecutor``, whose
``__init__`` runs ``model_engine.warmup`` (and the draft engine's). ``shutdown()`` waits on an
event only the worker loop sets, so on an executor whose worker never started it would block
forever: here it raises instead, to make that hazard visible. It then shuts *every* resource
manager down (the KV pools with them) and drops the engines. The worker runs requests when they
are awaited: each dummy step allocates the forward's activation peak (``trtllm/forward``); an
allocation failure becomes an error response, as the worker reports errors.
"""

from __future__ import annotations

from typing import Any

from bootstrap.backends.activations import block_table_bytes
from bootstrap.devices import DeviceOutOfMemory
from helpers.fake_trtllm import checked, export


@export("Request")
class Request:
    @checked("Request")
    def __init__(
        self,
        input_token_ids: list[int],
        *,
        max_tokens: int = 1,
        streaming: bool = False,
        sampling_config: Any = None,
        output_config: Any = None,
        end_id: int | None = None,
    ) -> None:
        self.input_token_ids, self.max_tokens = list(input_token_ids), max_tokens


@export("SamplingConfig")
class SamplingConfig:
    @checked("SamplingConfig")
    def __init__(self, beam_width: int = 1) -> None:
        self.beam_width = beam_width


@export("OutputConfig")
class OutputConfig:
    @checked("OutputConfig")
    def __init__(self) -> None:
        pass


@export("fake:LlmResponse")
class LlmResponse:
    def __init__(self, request_id: int, error_msg: str | None = None) -> None:
        self.request_id, self.error_msg = request_id, error_msg

    @checked("LlmResponse.has_error")
    def has_error(self) -> bool:
        return self.error_msg is not None


@export("fake:PyExecutor")
class PyExecutor:
    def __init__(
        self,
        resources: dict,
        *,
        model_engine: Any,
        drafter: Any,
        sampler: Any,
        dist: Any,
        max_batch_size: int,
        max_num_tokens: int,
        max_seq_len: int,
    ) -> None:
        self.resource_manager = resources  # TRT wraps them in a ResourceManager
        self.model_engine, self.drafter, self.sampler, self.dist = model_engine, drafter, sampler, dist
        self.max_num_tokens, self.max_seq_len = max_num_tokens, max_seq_len
        self.is_warmup, self.enable_iter_perf_stats, self.gather_all_responses = False, False, False
        self.worker_started, self.is_shutdown, self._queue, self._next_id = False, False, {}, 0
        kv = self._kinds.KV_CACHE_MANAGER
        tables = (
            block_table_bytes(max_batch_size, max_seq_len, resources[kv].tokens_per_block, 2) if kv in resources else 0
        )
        self._state = self._trt.allocate(tables, "trtllm/executor", self)
        for engine in (model_engine, getattr(drafter, "draft_model_engine", None)):
            if engine is not None:
                engine.warmup(resources)
        self._trt.log.append("PyExecutor.__init__ (warmup)")

    @property
    def _kinds(self) -> Any:
        return self._trt.cls("ResourceManagerType")

    @checked("PyExecutor.set_gather_responses")
    def set_gather_responses(self, gather_all_responses: bool) -> None:
        self.gather_all_responses = gather_all_responses

    @checked("PyExecutor.start_worker")
    def start_worker(self) -> None:
        self.worker_started = True  # guarded by worker_lock in TRT: a second call does nothing

    @checked("PyExecutor.enqueue_requests")
    def enqueue_requests(self, requests: list[Any], result_wait_queue: Any = None) -> list[int]:
        assert not self.is_shutdown, "PyExecutor has already been shutdown."
        ids = list(range(self._next_id, self._next_id + len(requests)))
        self._queue.update(zip(ids, requests))
        self._next_id += len(requests)
        return ids

    @checked("PyExecutor.await_responses")
    def await_responses(self, id: Any = None, timeout: Any = None) -> list[Any]:
        if not self.worker_started:
            raise RuntimeError("await_responses without a started worker would wait forever")
        ids = list(self._queue) if id is None else ([id] if isinstance(id, int) else list(id))
        requests = [self._queue.pop(i) for i in ids]
        error = self._run(requests)
        return [self._trt.cls("fake:LlmResponse")(i, error) for i in ids]

    def _run(self, requests: list[Any]) -> str | None:
        """One context step over the requests (at most ``max_num_tokens`` tokens), then free it."""
        kv = self.resource_manager.get(self._kinds.KV_CACHE_MANAGER)
        lengths = [len(r.input_token_ids) + r.max_tokens for r in requests]
        admitted = [n for n in lengths if kv.admit(n)]
        try:
            if len(admitted) < len(lengths):
                return (
                    f"a request of {max(lengths)} tokens does not fit the KV cache ({kv.full_length_tokens()} tokens)"
                )
            tokens = min(sum(lengths), self.max_num_tokens)
            self._trt.allocate(self.model_engine.forward_bytes(tokens), "trtllm/forward", self).release()
        except DeviceOutOfMemory as exc:
            return f"Executor error: CUDA out of memory. {exc}"
        finally:
            for n in admitted:
                kv.free(n)
        return None

    @checked("PyExecutor.shutdown")
    def shutdown(self) -> None:
        if not self.worker_started:
            raise RuntimeError("PyExecutor.shutdown() before start_worker(): shutdown_event.wait() would never return")
        assert not self.is_shutdown, "PyExecutor.shutdown() called twice: the shutdown request queue is closed"
        self.is_shutdown, self.worker_started = True, False
        for manager in self.resource_manager.values():
            if manager is not None and hasattr(manager, "shutdown"):
                manager.shutdown()
        self._state.release()
        self.model_engine = self.drafter = self.sampler = None
        self._trt.log.append("PyExecutor.shutdown")


@export("fake:SeqSlotManager")
class SeqSlotManager:
    def __init__(self, max_num_sequences: int) -> None:
        self.max_num_sequences = max_num_sequences


@export("create_py_executor_instance")
@checked("create_py_executor_instance")
def create_py_executor_instance(
    trt: Any,
    *,
    dist: Any,
    resources: dict,
    mapping: Any,
    llm_args: Any,
    ctx_chunk_config: Any,
    model_engine: Any,
    start_worker: bool,
    sampler: Any,
    drafter: Any,
    max_seq_len: int | None = None,
    max_batch_size: int | None = None,
    max_num_tokens: int | None = None,
    **optional: Any,
) -> Any:
    kinds = trt.cls("ResourceManagerType")
    resources[kinds.SEQ_SLOT_MANAGER] = trt.cls("fake:SeqSlotManager")(max_batch_size)
    executor = trt.cls("fake:PyExecutor")(
        resources,
        model_engine=model_engine,
        drafter=drafter,
        sampler=sampler,
        dist=dist,
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
        max_seq_len=max_seq_len,
    )
    if start_worker:
        executor.start_worker()
    return executor


@export("_adjust_torch_mem_fraction")
@checked("_adjust_torch_mem_fraction")
def _adjust_torch_mem_fraction(trt: Any) -> None:
    trt.log.append("torch.cuda.set_per_process_memory_fraction")
