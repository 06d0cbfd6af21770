"""The native backend's part of the live operations (``bootstrap.stages.operation``): new
weights read into the serving model in place, and sleep level 1's trip to host memory."""

from __future__ import annotations

from collections.abc import Callable

import torch

from bootstrap.backends.artifacts import HostWeights, LoadedModel, WeightsPlan
from bootstrap.backends.native.checks import check_weights_dir, unreadable_as_source_error
from bootstrap.devices import Device
from bootstrap.engine.models.kv_scales import checkpoint_kv_scales
from bootstrap.engine.models.residency import HostCopy, offload
from bootstrap.engine.models.weights import plan_weights, safetensors_files
from bootstrap.pipeline.undo import Undo


class LiveWeights:
    """``TakesWeights`` and ``Sleeps`` for ``NativeBackend`` (its mixin)."""

    device: Device
    torch_device: torch.device
    _return_cached: Callable[[], None]
    _await_weights: Callable[[LoadedModel], float]

    def plan_weights(self, loaded: LoadedModel, path: str) -> WeightsPlan:
        """``path``'s headers against the target's parameters (``weights.plan_weights``): a
        checkpoint directory of the same architecture, every tensor present and of its shape;
        then every value finite (``WeightReads.check_finite``), all while the old weights serve."""
        target = loaded.handle.target
        self._await_weights(loaded)  # a read still running would write over the new weights
        directory = check_weights_dir(path, target.hf_config)
        with unreadable_as_source_error(path):
            files = safetensors_files(directory)
            reads = plan_weights(target.model, files)
            scales = checkpoint_kv_scales(files, target.hf_config.num_hidden_layers)
            # The values are read once here, before the drain, and again in place after it (from the
            # page cache where it holds them): a NaN found by the in-place read would leave the
            # parameters half overwritten. A staging copy would need the weights' size again on the
            # device; reading the old weights back after a failure would cut the streams in flight.
            # This read adds no downtime (it runs before the drain): 2.47 GB of bfloat16 took 0.9 to 1.4 s
            # on two CPU cores, about 1.5 times the in-place read from the page cache.
            reads.check_finite()
        return WeightsPlan((reads, target.kv_scales, scales), path, reads.nbytes)

    def read_weights(self, plan: WeightsPlan) -> int:
        """The weights in place, and the new checkpoint's KV scales for the pools (taken when the
        executor starts again: ``start_executor``)."""
        reads, kept, scales = plan.handle
        reads.read()
        self.device.synchronize()
        kept.replace(scales)
        return plan.nbytes

    def offload_weights(self, loaded: LoadedModel, reuse: HostWeights | None, undo: Undo) -> HostWeights:
        """Target and draft to host memory, page-locked on CUDA (``residency.offload``, whose
        buffer a later sleep takes again); the allocator's cache goes back to the device."""
        self._await_weights(loaded)
        copies: dict[str, HostCopy] = {}
        undo.push(self._return_cached)
        for name, weights in loaded.handle.by_name().items():
            kept = reuse.handle.get(name) if reuse is not None else None
            copies[name] = copy = offload(weights.model, pin=self.torch_device.type == "cuda", reuse=kept)
            undo.push(copy.restore)
        self._return_cached()
        pinned = all(c.pinned for c in copies.values())
        return HostWeights(copies, sum(c.nbytes for c in copies.values()), pinned)

    def restore_weights(self, host: HostWeights) -> int:
        moved = sum(copy.restore() for copy in host.handle.values() if copy.holding)
        self.device.synchronize()
        return moved
