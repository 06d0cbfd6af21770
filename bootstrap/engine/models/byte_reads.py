"""Byte ranges of files read straight into tensors, by several threads at once.

``read_ranges(ranges)`` fills each ``ByteRange``'s destination (a contiguous tensor) with
``nbytes`` of its file from ``offset``. The work is cut into pieces of at most ``piece_bytes``
and shared by ``threads`` threads, each reading with ``os.preadv`` (which releases the GIL, so
the reads run in parallel and beside the start's other threads). A CPU destination is read into
in place; a CUDA destination goes through each thread's two page-locked staging buffers, one
read into while the other's copy to the device runs on the thread's own stream (ordinary host
memory page-locked for the read, ``cudaHostRegister``, and given back after it). This replaces
what ``safetensors`` does: a memory map, one thread, each tensor copied from pageable memory.
Each piece's floating-point values are checked finite as it is read (``finite``). Every thread is
joined before ``read_ranges`` returns, an error included; the first error is raised, naming the file.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from bootstrap.engine.models.finite import check_finite

PIECE_BYTES = 32 << 20
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ByteRange:
    """``nbytes`` of ``file`` from ``offset`` into ``destination`` (contiguous, that many bytes);
    ``name``: the checkpoint tensor's, for an error (its floating-point values checked finite)."""

    file: Path
    offset: int
    destination: torch.Tensor
    name: str = ""

    @property
    def nbytes(self) -> int:
        return self.destination.numel() * self.destination.element_size()


def default_threads() -> int:
    """Eight readers (page-cache copies scale to about that), fewer on a smaller machine."""
    return max(2, min(8, len(os.sched_getaffinity(0))))


def read_ranges(
    ranges: list[ByteRange],
    threads: int | None = None,
    piece_bytes: int = PIECE_BYTES,
    stop: threading.Event | None = None,
) -> None:
    """Fill every range's destination from its file; all destinations on one device. ``stop``,
    once set, ends the read after the pieces in flight (unfinished, no error)."""
    pieces = collections.deque(_pieces(ranges, piece_bytes))
    if not pieces:
        return
    device = pieces[0][2].device
    threads = min(threads or default_threads(), len(pieces))
    files = {r.file for r in ranges}
    fds = {}
    try:
        for file in files:
            fds[file] = os.open(file, os.O_RDONLY)
        failed = _Halt(stop)  # set by a thread that failed, or from outside: no thread takes more pieces
        work = _Staged(device, piece_bytes).work if device.type == "cuda" else _in_place
        with ThreadPoolExecutor(threads, thread_name_prefix="bootstrap-weights") as pool:
            futures = [pool.submit(work, pieces, fds, failed) for _ in range(threads)]
        for future in futures:
            future.result()  # the first error, after every thread has ended
    finally:
        for fd in fds.values():
            os.close(fd)


class _Halt:
    """An event a failing thread sets, that also reads as set once ``stop`` is (never setting it)."""

    def __init__(self, stop: threading.Event | None) -> None:
        self._failed, self._stop = threading.Event(), stop

    def set(self) -> None:
        self._failed.set()

    def is_set(self) -> bool:
        return self._failed.is_set() or (self._stop is not None and self._stop.is_set())


def _pieces(ranges: list[ByteRange], piece_bytes: int):
    """(file, offset, destination bytes, range) pieces of at most ``piece_bytes`` (whole elements
    of the destination's dtype), in file order."""
    for r in sorted(ranges, key=lambda r: (str(r.file), r.offset)):
        flat = r.destination.view(-1).view(torch.uint8) if r.nbytes else None
        size = r.destination.element_size()
        step = max(size, piece_bytes - piece_bytes % size)
        for start in range(0, r.nbytes, step):
            yield r.file, r.offset + start, flat[start : start + step], r


def _check(piece: torch.Tensor, r: ByteRange) -> None:
    """The piece's values (as the destination's dtype) finite: ``finite.check_finite``."""
    if r.destination.dtype.is_floating_point:
        check_finite(piece.view(r.destination.dtype), r.file, r.name or f"at byte {r.offset}")


def _taken(pieces: collections.deque, failed: _Halt):
    """The pieces this thread takes from the shared queue, until it is empty or a thread failed."""
    while not failed.is_set():
        try:
            yield pieces.popleft()
        except IndexError:
            return


def _in_place(pieces: collections.deque, fds: dict, failed: _Halt) -> None:
    """Read each piece straight into its (CPU) destination."""
    try:
        for file, offset, target, r in _taken(pieces, failed):
            _pread_into(fds[file], file, offset, target)
            _check(target, r)
    except BaseException:
        failed.set()
        raise


class _Staged:
    """Each thread's work for a CUDA destination: two page-locked buffers, one stream."""

    def __init__(self, device: torch.device, piece_bytes: int) -> None:
        self.device, self.piece_bytes = device, piece_bytes

    def work(self, pieces: collections.deque, fds: dict, failed: _Halt) -> None:
        buffers: list[PageLocked] = []
        stream = None
        copied = [None, None]  # the event of each buffer's last copy
        try:
            for _ in range(2):  # one by one: a failed second allocation still releases the first
                buffers.append(PageLocked(self.piece_bytes))
            stream = torch.cuda.Stream(self.device)
            turn = 0
            for file, offset, target, r in _taken(pieces, failed):
                if copied[turn] is not None:
                    copied[turn].synchronize()  # the buffer's previous copy has left it
                staging = buffers[turn].tensor[: target.numel()]
                _pread_into(fds[file], file, offset, staging)
                _check(staging, r)  # on the host, while the bytes are in this thread's cache
                with torch.cuda.stream(stream):
                    target.copy_(staging, non_blocking=True)
                    copied[turn] = torch.cuda.Event()
                    copied[turn].record(stream)
                turn ^= 1
        except BaseException:
            failed.set()
            raise
        finally:
            if stream is not None:
                stream.synchronize()
            for buffer in buffers:
                buffer.release()


class PageLocked:
    """``nbytes`` of host memory page-locked (``cudaHostRegister``) until ``release`` or until it
    is collected (pageable if the driver refuses)."""

    def __init__(self, nbytes: int) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.locked = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)) == 0
        if not self.locked:
            log.info("page-locking %d MB of host memory failed: the copies go through pageable memory", nbytes >> 20)
        # the tensor is held until unregistered: registered memory is never freed
        self._unlock = weakref.finalize(self, _unregister, self.tensor) if self.locked else None

    def release(self) -> None:
        if self._unlock is not None:
            self._unlock()  # runs once, however often called
        self.locked = False


def _unregister(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


def _pread_into(fd: int, file: Path, offset: int, target: torch.Tensor) -> None:
    """``target.numel()`` bytes of ``fd`` from ``offset`` into ``target`` (CPU, uint8, contiguous)."""
    view = memoryview((ctypes.c_char * target.numel()).from_address(target.data_ptr())).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:  # the file's size, not this read's offset: a piece may start past the end
            raise ValueError(
                f"{file}: ends at byte {os.fstat(fd).st_size}, its header places a tensor up to byte "
                f"{offset + len(view)}"
            )
        done += got
