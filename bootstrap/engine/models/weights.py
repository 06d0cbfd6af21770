"""Weights from a checkpoint directory's safetensors files straight into the engine's own model.

Every checkpoint tensor has one place: a parameter of the same name, or its rows of a fused
projection (``q_proj`` of ``qkv_proj``, ``gate_proj`` of ``gate_up_proj``: ``FUSED``). Under
tensor parallelism each rank reads only its slice of a sharded weight (``layers.linear``). The
places are worked out from the files' headers first (``plan_weights``), so a tensor the model does not have, a
parameter no tensor fills, a shape or dtype that differs, a tensor stored twice or a header whose
spans do not hold together (``headers``) is an error naming it before any weight is read. Then
every tensor whose slice is one run of bytes in the file, stored in the model's dtype, is read by
``byte_reads`` straight into its place (threads, page-locked staging on CUDA); the rest (a dtype
to convert, a column slice under tensor parallelism) through ``safetensors`` (``WeightReads.read``;
``load_weights`` is the two in a row). A 16-bit weight read into an FP8 projection
(``quantization: fp8``) is quantized on its way, a few rows at a time, each row with its own scale.
The model is built on the meta device first, so no second full copy of the weights ever exists.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from bootstrap.engine.layers.fp8 import FP8, SCALE_NAMES, quantize_rows
from bootstrap.engine.layers.linear import FusedLinear, Index, RowLinear
from bootstrap.engine.models.byte_reads import PIECE_BYTES, ByteRange, read_ranges
from bootstrap.engine.models.files import ModelSourceError, check_regular, exists, read_json
from bootstrap.engine.models.finite import check_finite
from bootstrap.engine.models.headers import DTYPES, check_header
from bootstrap.engine.models.scales import check_weight_scales
from bootstrap.paths import open_regular

FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
IGNORED = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry; recomputed here
KV_SCALES = {  # an FP8 KV cache's per-layer scales (compressed-tensors' names, then older ones): the pool's
    "self_attn.k_scale": 0,
    "self_attn.v_scale": 1,
    "self_attn.k_proj.output_scale": 0,
    "self_attn.v_proj.output_scale": 1,
}
QUANTIZE_ROWS_BYTES = 64 << 20  # float32 rows quantized at once (``_read_quantizing``)
SCAN_BYTES = 256 << 20  # the host buffer ``WeightReads.check_finite`` reads through


@dataclass(frozen=True)
class Stored:
    """One tensor of a safetensors file, from its header: dtype name, shape, first byte."""

    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files, in the order its index lists them, each checked to be a
    regular file (``files.check_regular``)."""
    index = path / "model.safetensors.index.json"
    if exists(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelSourceError(f"{index}: field 'weight_map' must be an object of tensor name -> file name")
        return [check_regular(path / name) for name in dict.fromkeys(weight_map.values())]
    single = path / "model.safetensors"
    return [check_regular(single)] if exists(single) else []


def stored_tensors(file: Path) -> list[Stored]:
    """The tensors a safetensors file holds, from its header (8 bytes of length, JSON), checked
    as ``safetensors`` checks it (``headers.check_header``) before any weight is read."""
    with open_regular(check_regular(file).resolve()) as fd:
        size = os.fstat(fd).st_size
        length = struct.unpack("<Q", os.pread(fd, 8, 0))[0] if size >= 8 else size
        if length > size - 8:
            raise ModelSourceError(
                f"{file} cannot be read: not a safetensors file (a file of {size} bytes)"  # no byte of it quoted
            )
        try:
            header = json.loads(os.pread(fd, length, 8))
        except (UnicodeDecodeError, json.JSONDecodeError):  # their messages quote the bytes
            raise ModelSourceError(f"{file} cannot be read: not a safetensors file (its header is not JSON)") from None
    spans = check_header(file, header, size - 8 - length)
    return [Stored(file, name, dtype, shape, 8 + length + begin) for name, dtype, shape, begin in spans]


def load_weights(
    model: torch.nn.Module, files: list[Path], threads: int | None = None, piece_bytes: int = PIECE_BYTES
) -> None:
    """Fill every parameter of ``model`` (already on its device, in its dtype) from ``files``
    (``threads`` and ``piece_bytes``: ``byte_reads.read_ranges``'s): ``plan_weights``, then its ``read``."""
    plan_weights(model, files).read(threads, piece_bytes)


@dataclass(frozen=True)
class WeightReads:
    """The checked reads of a checkpoint into a model's parameters (``plan_weights``): byte ranges
    read straight into their places, and slices read through ``safetensors`` to convert. It holds
    the parameters' storage as it was when planned: read it before their data is replaced."""

    direct: tuple[ByteRange, ...]
    converted: tuple[tuple[Stored, torch.Tensor, Index], ...]
    quantized: tuple[tuple[Stored, torch.Tensor, torch.Tensor, Index], ...] = ()  # and the rows' scales

    @property
    def nbytes(self) -> int:
        """The bytes ``read`` reads from the files."""
        slices = [(stored, target) for stored, target, _ in self.converted]
        slices += [(stored, target) for stored, target, _, _ in self.quantized]
        return sum(r.nbytes for r in self.direct) + sum(t.numel() * DTYPES[s.dtype].itemsize for s, t in slices)

    def read(
        self, threads: int | None = None, piece_bytes: int = PIECE_BYTES, stop: threading.Event | None = None
    ) -> None:
        """Every planned tensor into its place, in place (same storage, same addresses)."""
        with torch.no_grad():
            read_ranges(list(self.direct), threads, piece_bytes, stop)
            for read, items in ((_read_converting, self.converted), (_read_quantizing, self.quantized)):
                if stop is None or not stop.is_set():
                    read(list(items))

    def check_finite(self, threads: int | None = None, piece_bytes: int = PIECE_BYTES) -> int:
        """Every value ``read`` would write checked finite as it would land (converted to its
        parameter's dtype; a weight quantized at load, as stored), read through a host buffer of at
        most ``SCAN_BYTES`` with no parameter written: ``ModelSourceError`` naming the tensor. The
        bytes read."""
        with torch.no_grad():
            buffer = torch.empty(min(SCAN_BYTES, sum(r.nbytes for r in self.direct)) + 64, dtype=torch.uint8)
            for batch in _on_host(self.direct, buffer):
                read_ranges(batch, threads, piece_bytes)  # checks each piece as it reads it
            for tensor, (stored, target, _) in _stored_slices(list(self.converted), lambda target: "cpu"):
                check_finite(tensor.to(target.dtype), stored.file, stored.name)
            for tensor, (stored, *_) in _stored_slices(list(self.quantized), lambda target: "cpu"):
                check_finite(tensor, stored.file, stored.name)
        return self.nbytes


def _on_host(ranges: tuple[ByteRange, ...], buffer: torch.Tensor) -> Iterator[list[ByteRange]]:
    """``ranges`` (cut into parts of at most the buffer's size) as batches of ranges of the same
    bytes whose destinations are views of ``buffer``, each batch filling it at most once."""
    batch: list[ByteRange] = []
    at, limit = 0, buffer.numel() - 64
    for r in ranges:
        size = r.destination.element_size()
        step = max(size, limit - limit % size)
        for start in range(0, r.nbytes, step):
            nbytes = min(step, r.nbytes - start)
            at = -(-at // 16) * 16  # aligned for any dtype's view
            if batch and at + nbytes > buffer.numel():
                yield batch
                batch, at = [], 0
            place = buffer[at : at + nbytes].view(r.destination.dtype)
            batch.append(ByteRange(r.file, r.offset + start, place, r.name))
            at += nbytes
    if batch:
        yield batch


def plan_weights(model: torch.nn.Module, files: list[Path]) -> WeightReads:
    """Where each tensor of ``files`` goes in ``model``, every check done (``ModelSourceError``
    naming the tensor) and no weight read."""
    on_meta = [name for name, param in model.named_parameters() if param.is_meta]
    if on_meta:
        raise ValueError(f"parameter {on_meta[0]} has no storage (meta): reallocate the model before reading into it")
    return check_weights(model, files)


def check_weights(model: torch.nn.Module, files: list[Path]) -> WeightReads:
    """``plan_weights``'s checks, on a model that may be on the meta device (its reads then
    have no destination: only the checks count)."""
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied head under both names
    modules = dict(model.named_modules())
    direct: list[ByteRange] = []
    converted: list[tuple[Stored, torch.Tensor, Index]] = []
    quantized: list[tuple[Stored, torch.Tensor, torch.Tensor, Index]] = []
    filled: set[str] = set()
    parts: set[tuple[str, str]] = set()  # (fused parameter, part) filled
    scales: list[tuple[Path, str]] = []  # FP8 weight scales, their values checked
    seen: dict[str, Path] = {}
    for file in files:
        for stored in stored_tensors(file):
            if stored.name in seen:
                raise ModelSourceError(
                    f"checkpoint tensor {stored.name!r} is stored twice: in {seen[stored.name]} and {file}"
                )
            seen[stored.name] = file
            if stored.name.endswith(IGNORED) or stored.name.endswith(tuple(KV_SCALES)):
                continue
            name, target, index = _place(stored, params, modules)
            if DTYPES[stored.dtype].is_floating_point != target.dtype.is_floating_point:
                raise ModelSourceError(
                    f"{file}: tensor {stored.name!r} is stored as {stored.dtype}, the model's {name} is {target.dtype}"
                )
            part = _fused_part(stored.name)
            (parts.add((name, part)) if part else filled.add(name))
            if stored.name.rpartition(".")[2] in SCALE_NAMES:
                scales.append((file, stored.name))
            if target.dtype == FP8 and DTYPES[stored.dtype] != FP8:  # quantized at load: its scales too
                scale_name, scale = _scale_of(stored, modules)
                (parts.add((scale_name, part)) if part else filled.add(scale_name))
                quantized.append((stored, target, scale, index))
                continue
            start = _contiguous_start(index, stored.shape)
            whole = math.prod(_sliced_shape(index, stored.shape)) == target.numel()  # not a scale filling rows
            if start is not None and whole and DTYPES.get(stored.dtype) == target.dtype and target.is_contiguous():
                at = stored.offset + start * target.element_size()
                direct.append(ByteRange(file, at, target.detach(), stored.name))
            else:
                converted.append((stored, target, index))
    tied = _tied(model)
    if filled & tied:  # the shared tensor came under one of its two names: both are filled
        filled |= tied
    missing = sorted(set(params) - filled - _fused(modules)) + _missing_parts(modules, parts)
    if missing:
        raise ModelSourceError(
            f"the checkpoint has no tensor for {len(missing)} parameter(s): {', '.join(missing[:5])}"
        )
    check_weight_scales(scales)
    return WeightReads(tuple(direct), tuple(converted), tuple(quantized))


def _fused_part(name: str) -> str | None:
    """The part (``q_proj``, ...) a checkpoint tensor fills of a fused projection, or None."""
    part = name.rpartition(".")[0].rpartition(".")[2]
    return part if part in FUSED else None


def _fused(modules: dict) -> set[str]:
    """The fused projections' parameters, which only all their parts fill (``_missing_parts``)."""
    return {f"{name}.{kind}" for name, m in modules.items() if isinstance(m, FusedLinear) for kind, _ in _kinds(m)}


def _kinds(module: FusedLinear) -> list[tuple[str, str]]:
    """Each parameter of a fused projection and the checkpoint's name for it (``weight_scale_inv``
    for block-wise scales)."""
    names = {"weight_scale": "weight_scale_inv" if getattr(module, "fp8_block", None) else "weight_scale"}
    return [(kind, names.get(kind, kind)) for kind, param in module.named_parameters() if param is not None]


def _missing_parts(modules: dict, parts: set[tuple[str, str]]) -> list[str]:
    """The checkpoint's name of every part of a fused parameter that no tensor filled."""
    missing = []
    for name, module in modules.items():
        if isinstance(module, FusedLinear):
            parent = name.rpartition(".")[0]
            for kind, stored in _kinds(module):
                missing += [f"{parent}.{p}.{stored}" for p in module.parts if (f"{name}.{kind}", p) not in parts]
    return sorted(missing)


def _place(stored: Stored, params: dict, modules: dict) -> tuple[str, torch.Tensor, Index]:
    """The parameter checkpoint tensor ``stored`` fills, the part of it that this rank's slice
    lands in, and that slice of the stored tensor."""
    owner, _, kind = stored.name.rpartition(".")
    kind = "weight_scale" if kind in SCALE_NAMES else kind  # block-wise fp8's weight_scale_inv multiplies too
    parent, _, part = owner.rpartition(".")
    if part in FUSED:
        fused = f"{parent}.{FUSED[part]}"
        module = modules.get(fused)
        if not isinstance(module, FusedLinear):
            raise ModelSourceError(f"checkpoint tensor {stored.name!r} has no place in this model (no {fused!r})")
        index = module.checkpoint_index(part, kind, stored.shape)
        try:
            target = module.part_target(part, kind, _sliced_shape(index, stored.shape))
        except ValueError as exc:  # a part's rows or columns that do not fit the fused projection
            raise ModelSourceError(f"{stored.file}: tensor {stored.name!r}: {exc}") from None
        return f"{fused}.{kind}", target, index
    name = f"{owner}.{kind}"
    param = params.get(name)
    if param is None:
        raise ModelSourceError(f"checkpoint tensor {stored.name!r} has no place in this model")
    module = modules[owner]
    index = module.checkpoint_index(None, kind, stored.shape) if isinstance(module, RowLinear) else ()
    shape = _sliced_shape(index, stored.shape)
    if kind == "weight_scale" and math.prod(shape) == 1:
        return name, param, index  # one scale for the whole tensor: it fills every row
    if tuple(param.shape) != shape:
        raise ModelSourceError(f"{stored.name}: checkpoint shape {shape}, the model's {tuple(param.shape)}")
    return name, param, index


def _scale_of(stored: Stored, modules: dict) -> tuple[str, torch.Tensor]:
    """The row scales a 16-bit weight quantized at load fills: its rows of the (fused) projection's."""
    owner = stored.name.rpartition(".")[0]
    parent, _, part = owner.rpartition(".")
    if part in FUSED:
        module = modules[f"{parent}.{FUSED[part]}"]
        return f"{parent}.{FUSED[part]}.weight_scale", module.weight_scale[module.parts[part]]
    return f"{owner}.weight_scale", modules[owner].weight_scale


def _bounds(index: Index, shape: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(start, stop, step) of ``index`` in each dimension of ``shape`` (a missing one: all of it)."""
    full = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return [s.indices(n) for s, n in zip(full, shape)]


def _sliced_shape(index: Index, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(len(range(*bounds)) for bounds in _bounds(index, shape))


def _contiguous_start(index: Index, shape: tuple[int, ...]) -> int | None:
    """The first element of ``index``'s slice when the slice is one run of the stored tensor's
    elements (row slices are; column slices of a matrix are not): else None."""
    bounds = _bounds(index, shape)
    if any(step != 1 for _, _, step in bounds):
        return None
    partial = [dim for dim, ((begin, end, _), n) in enumerate(zip(bounds, shape)) if (begin, end) != (0, n)]
    if not partial:
        return 0
    dim = partial[0]
    if len(partial) > 1 or math.prod(shape[:dim]) != 1:
        return None
    return bounds[dim][0] * math.prod(shape[dim + 1 :])


def _read_converting(items: list[tuple[Stored, torch.Tensor, Index]]) -> None:
    """Through ``safetensors``: the slices to convert to the model's dtype, or not one run of bytes."""
    for tensor, (stored, target, _) in _stored_slices(items, lambda target: str(target.device)):
        tensor = tensor.to(target.dtype)
        check_finite(tensor, stored.file, stored.name)  # after the conversion: none may overflow
        target.copy_(tensor)  # a per-tensor scale broadcasts over its rows


def _read_quantizing(items: list[tuple[Stored, torch.Tensor, torch.Tensor, Index]]) -> None:
    """16-bit weights into FP8 projections: read on the host, quantized on the weights' device
    ``QUANTIZE_ROWS_BYTES`` of float32 rows at a time (a tensor's whole float32 copy would be
    the transient the plan does not hold)."""
    for tensor, (stored, target, scale, _) in _stored_slices(items, lambda target: "cpu"):
        step = max(1, QUANTIZE_ROWS_BYTES // (4 * tensor.shape[1]))
        for begin in range(0, tensor.shape[0], step):
            rows = tensor[begin : begin + step].to(target.device, non_blocking=False)
            check_finite(rows, stored.file, stored.name)
            weight, row_scale = quantize_rows(rows)
            target[begin : begin + step].copy_(weight)
            scale[begin : begin + step].copy_(row_scale)


def _stored_slices(items: list[tuple], device: Callable[[torch.Tensor], str]) -> Iterator[tuple[torch.Tensor, tuple]]:
    """Each item's stored slice (``(stored, target, ..., index)``), each file opened once, read
    onto ``device(target)`` of the file's first item."""
    by_file: dict[Path, list[tuple]] = {}
    for item in items:
        by_file.setdefault(item[0].file, []).append(item)
    for file, group in by_file.items():
        with safe_open(str(file), framework="pt", device=device(group[0][1])) as reader:
            for item in group:
                stored, index = item[0], item[-1]
                yield (reader.get_slice(stored.name)[index] if index else reader.get_tensor(stored.name)), item


def _tied(model: torch.nn.Module) -> set[str]:
    """The two names of one tensor when the head is tied to the embeddings (checkpoints store
    either name, or both)."""
    head, embed = model.get_output_embeddings().weight, model.model.embed_tokens.weight
    return {"lm_head.weight", "model.embed_tokens.weight"} if head is embed else set()


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under the checkpoint's names, fused projections split back into their
    parts (views, no copies): what a loaded checkpoint held, to compare it with its source."""
    modules = dict(model.named_modules())
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner, _, kind = name.rpartition(".")
        module = modules[owner]
        if isinstance(module, FusedLinear):
            parent = owner.rpartition(".")[0]
            out |= {f"{parent}.{part}.{kind}": param[rows] for part, rows in module.parts.items()}
        else:
            out[name] = param
    return out
