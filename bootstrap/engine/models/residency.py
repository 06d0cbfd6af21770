"""Where a model's parameters live: on its device, in host memory, or nowhere (sleep and wake).

``offload`` copies every parameter's data into one flat host buffer and releases the device
storage; ``HostCopy.restore`` copies it back. ``drop`` releases it outright (``meta`` tensors) and
``reallocate`` gives it fresh uninitialised storage for ``reload.reload_weights`` (or
``weights.plan_weights(...).read()``) to fill again. The ``nn.Parameter`` objects stay (their
``data`` is replaced), so the modules holding them, and a head tied to the embeddings, keep
working; each storage moves once, so a tie stays one tensor. Buffers (rotary frequencies) stay
where they are. No layer keeps a tensor derived from a parameter (each reads ``self.weight`` per
call), but restore and reallocate give the parameters new device addresses: CUDA graphs captured
on them must be captured again. Released device memory goes back to torch's caching allocator
(``torch.cuda.empty_cache`` hands it on). Call these with no forward running.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bootstrap.engine.models.byte_reads import PageLocked

ALIGN = 256  # each storage's first byte in a flat buffer: aligned for every dtype


@dataclass(frozen=True)
class _Placed:
    """One parameter's view of its storage: dtype, first element, shape and strides."""

    param: torch.nn.Parameter
    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of(cls, param: torch.nn.Parameter) -> _Placed:
        return cls(param, param.dtype, param.storage_offset(), tuple(param.shape), param.stride())

    def view(self, flat: torch.Tensor, start: int) -> torch.Tensor:
        """The same view of the storage copied to byte ``start`` of ``flat`` (uint8, whole, aligned)."""
        first = start // self.dtype.itemsize + self.offset
        return flat.view(self.dtype).as_strided(self.shape, self.stride, first)


@dataclass(frozen=True)
class _Storage:
    """A storage's bytes at ``start`` of the host buffer, and the parameters viewing it."""

    start: int
    nbytes: int
    placed: tuple[_Placed, ...]


@dataclass(eq=False)
class HostCopy:
    """A model's parameters in host memory (``offload``), until ``restore`` moves them back. Its
    buffer outlives the restore, for the next ``offload`` of the model to take again."""

    device: torch.device
    storages: tuple[_Storage, ...]
    flat: torch.Tensor  # uint8, every storage at its ``start``
    lock: PageLocked | None  # the page-locking of ``flat`` (None: pageable memory was asked for)
    holding: bool = True  # the parameters' data is in ``flat`` now

    @property
    def nbytes(self) -> int:
        return sum(storage.nbytes for storage in self.storages)

    @property
    def pinned(self) -> bool:
        return self.lock is not None and self.lock.locked

    def restore(self) -> int:
        """Every parameter back on its device, in fresh storage; the bytes moved. All or nothing:
        after an error (out of memory) every parameter is in host memory still."""
        if not self.holding:
            raise ValueError("restore: these weights are back on the device already")
        done: list[_Storage] = []
        try:
            for storage in self.storages:
                fresh = torch.empty(_aligned(storage.nbytes), dtype=torch.uint8, device=self.device)
                fresh[: storage.nbytes].copy_(
                    self.flat[storage.start : storage.start + storage.nbytes], non_blocking=True
                )
                _point(storage, fresh, 0)
                done.append(storage)
            _synchronize(self.device)  # the buffer is free to be written again
        except BaseException:
            for storage in done:
                _point(storage, self.flat, storage.start)
            raise
        self.holding = False
        return self.nbytes

    def release(self) -> None:
        """Unlock the buffer's pages now (else when it is collected)."""
        if self.lock is not None:
            self.lock.release()


def offload(model: torch.nn.Module, *, pin: bool, reuse: HostCopy | None = None) -> HostCopy:
    """Every parameter's data copied to host memory (page-locked when ``pin`` and the model is
    on CUDA) and its device storage released; ``reuse``: an earlier, restored copy of this model.
    One flat buffer, locked once and kept for later offloads: page-locking is slow to set up."""
    device = _device(model)
    storages, end = [], 0
    for params in _by_storage(model).values():
        nbytes = params[0].untyped_storage().nbytes()
        storages.append(_Storage(end, nbytes, tuple(_Placed.of(param) for param in params)))
        end += _aligned(nbytes)
    pin = pin and device.type == "cuda"
    if reuse is not None and reuse.holding:
        raise ValueError("reuse: that host copy still holds weights that were never restored")
    if reuse is not None and reuse.flat.numel() >= end and (reuse.lock is not None) == pin:
        flat, lock = reuse.flat, reuse.lock
    else:
        lock = PageLocked(end) if pin else None
        flat = lock.tensor if lock is not None else torch.empty(end, dtype=torch.uint8)
    for storage in storages:
        source = storage.placed[0].param.untyped_storage()
        whole = torch.empty(0, dtype=torch.uint8, device=device).set_(source)
        flat[storage.start : storage.start + storage.nbytes].copy_(whole, non_blocking=True)
    _synchronize(device)
    for storage in storages:
        _point(storage, flat, storage.start)
    return HostCopy(device, tuple(storages), flat, lock)


def drop(model: torch.nn.Module) -> int:
    """Every parameter's data replaced by a ``meta`` tensor of its shape and dtype; the bytes
    released. ``ValueError`` first where two parameters share a storage (a tie other than one
    parameter in two modules): ``reallocate`` could not share it again."""
    groups = _by_storage(model, named=True)
    shared = next((names for names in groups.values() if len(names) > 1), None)
    if shared is not None:
        raise ValueError(f"drop: parameters {', '.join(shared)} share one storage; offload the model instead")
    params = dict(model.named_parameters())
    released = 0
    for (name,) in groups.values():
        param = params[name]
        released += param.untyped_storage().nbytes()
        _hold(param, torch.empty(param.shape, dtype=param.dtype, device="meta"))
    return released


def reallocate(model: torch.nn.Module, device: torch.device | str) -> int:
    """Fresh uninitialised storage on ``device`` for every parameter (a tied one stays one
    tensor); the bytes allocated. After an error (out of memory) every parameter is ``meta``."""
    done: list[torch.nn.Parameter] = []
    try:
        for param in model.parameters():  # each parameter once: a tied head is the embeddings' own
            _hold(param, torch.empty(param.shape, dtype=param.dtype, device=device))
            done.append(param)
    except BaseException:
        for param in model.parameters():
            _hold(param, torch.empty(param.shape, dtype=param.dtype, device="meta"))
        raise
    return sum(param.numel() * param.element_size() for param in done)


def _by_storage(model: torch.nn.Module, named: bool = False) -> dict[int, list]:
    """The parameters (or their names) grouped by the storage they view; meta ones left out."""
    groups: dict[int, list] = {}
    for name, param in model.named_parameters():  # each parameter once
        if not param.is_meta:
            storage = param.untyped_storage()
            key = storage.data_ptr() if storage.nbytes() else id(param)
            groups.setdefault(key, []).append(name if named else param)
    return groups


def _device(model: torch.nn.Module) -> torch.device:
    devices = {param.device for param in model.parameters()}
    if torch.device("meta") in devices:
        raise ValueError("offload: the model's weights were dropped (meta); reallocate and read them first")
    if len(devices) != 1:
        raise ValueError(f"offload: the model's parameters are on {len(devices)} devices ({sorted(map(str, devices))})")
    return devices.pop()


def _hold(param: torch.nn.Parameter, data: torch.Tensor) -> None:
    """``param``, the same object, holding ``data``. Between ``meta`` and a device ``param.data =``
    refuses (another tensor type): ``torch.utils.swap_tensors`` swaps the contents of ``param``
    and a new parameter given its attributes."""
    if torch._has_compatible_shallow_copy_type(param, data):
        param.data = data
        return
    new = torch.nn.Parameter(data, requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)
    torch.utils.swap_tensors(param, new)


def _point(storage: _Storage, flat: torch.Tensor, start: int) -> None:
    """The storage's parameters made views of its bytes at ``start`` of ``flat``."""
    for placed in storage.placed:
        placed.param.data = placed.view(flat, start)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
