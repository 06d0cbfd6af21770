"""The engine's process as the server sees it (``bootstrap.api.engine_process``).

``EngineSpawn`` binds the control plane's two sockets in a private directory (mode 0700: no
other user connects), starts the process (as early as the command can: its imports of torch
run beside the server's own), and relays its stderr line by line to the server's, keeping the
last line for the log should the process die. The same thread waits for the exit and hands the
status to ``on_exit`` on the event loop. ``stop`` waits for the exit (the ``aclose`` call
ended it), kills a process that does not exit, and closes everything; no thread outlives it.
A server killed outright leaves its folder behind; the next spawn removes such folders
(``remove_stale_folders``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

if TYPE_CHECKING:  # the rest comes with ``listen``: the command starts this before its own imports
    from bootstrap.api import control as c
    from bootstrap.engine.executor.channel.threads import Receiver

MODULE = "bootstrap.api.engine_process"
PREFIX = "bootstrap-engine-"  # each server's socket folder
MAX_PARENT = 107 - len(f"/{PREFIX}12345678/") - len("cmd9999")  # its sockets' paths fit in 107 bytes
EXIT_WAIT_S = 30.0  # after the aclose call answered: the process's own exit (its threads, its device)


def remove_stale_folders(parent: str) -> None:
    """Remove the socket folders of servers that are gone (one SIGKILLed has no chance to): a
    ``PREFIX`` folder of this user that holds sockets only, its ``calls`` socket refusing a
    connection (nobody listens)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            if entry.name.startswith(PREFIX) and _stale(entry):
                shutil.rmtree(entry.path, ignore_errors=True)


def _stale(entry: os.DirEntry) -> bool:
    try:
        if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
            return False
        if not all(stat.S_ISSOCK(inner.stat(follow_symlinks=False).st_mode) for inner in os.scandir(entry.path)):
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(os.path.join(entry.path, "calls"))
        return False  # a live server's
    except ConnectionRefusedError:
        return True
    except OSError:  # no calls socket yet (a server binding it now), a path too long: left alone
        return False


def _parent() -> str:
    """Where the folder goes: the temporary directory, or ``/tmp`` where that one's path is too
    long for the sockets inside (a Unix socket's path has at most 107 bytes)."""
    parent = tempfile.gettempdir()
    return parent if len(parent) <= MAX_PARENT else "/tmp"


def begins_triton(device: str, backend_factory: str | None) -> bool:
    """Whether the engine's process begins Triton's start first thing: a native engine on CUDA."""
    return backend_factory is None and device.startswith("cuda")


class EngineSpawn:
    """One engine process, started at once (its imports run while the server imports its own);
    ``listen`` (on the event loop) then gives it ``on_note``, called on the notes thread with each
    decoded message, and ``on_exit(status, last_line)``, called on the event loop."""

    def __init__(self, log_level: str = "info", triton: bool = False) -> None:
        """``triton``: the engine begins Triton's start (``engine.kernels.triton_start``) at once,
        before its imports (a native engine on CUDA), as a server with the engine inside does."""
        self.flags = (log_level, triton)  # what it was started with: a later start that wants others makes its own
        self.dir = tempfile.mkdtemp(prefix=PREFIX, dir=_parent())
        self.context = zmq.Context()
        self._calls = self.context.socket(zmq.PUSH)
        self._calls.setsockopt(zmq.LINGER, 0)
        self._calls.setsockopt(zmq.SNDHWM, 0)
        calls, notes = f"ipc://{self.dir}/calls", f"ipc://{self.dir}/notes"
        self._calls.bind(calls)
        self._notes_socket = self.context.socket(zmq.PULL)
        self._notes_socket.setsockopt(zmq.RCVHWM, 0)
        self._notes_socket.bind(notes)
        self._notes: Receiver | None = None
        self._lock = threading.Lock()  # the exit against ``listen``: told once, after both
        self._on_exit: Callable[[int, str], None] | None = None
        self.call_soon: Callable[..., object] | None = None
        self.last_line = ""
        self.status: int | None = None
        self._stopped = False
        argv = [sys.executable, "-m", MODULE, calls, notes, str(os.getpid()), log_level, "triton" if triton else "-"]
        self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._watch = threading.Thread(target=self._relay, name="bootstrap-engine-watch", daemon=True)
        self._watch.start()
        remove_stale_folders(os.path.dirname(self.dir))

    @property
    def pid(self) -> int:
        return self.process.pid

    def listen(self, on_note: Callable[[c.FromEngine], None], on_exit: Callable[[int, str], None]) -> None:
        """On the event loop that will read the engine (once)."""
        from bootstrap.api import control as c
        from bootstrap.engine.executor.channel.threads import Receiver
        from bootstrap.engine.executor.event_loops import call_soon_threadsafe

        self.call_soon = call_soon_threadsafe()
        self._notes = Receiver(
            self.context,
            self._notes_socket,
            lambda frame: on_note(c.decode_from_engine(frame)),
            "bootstrap-engine-notes",
        )
        self._notes.start()
        with self._lock:
            self._on_exit, exited = on_exit, self.status
        if exited is not None:  # it ended before anyone listened
            self.call_soon(on_exit, exited, self.last_line)

    def send(self, message: c.ToEngine) -> None:
        """On the event loop; dropped once the process has exited."""
        from bootstrap.api import control as c

        if self.status is None and not self._calls.closed:
            self._calls.send(c.encode(message))

    def _relay(self) -> None:
        """The process's stderr to this one's, line by line; then its exit to the event loop."""
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line.strip():
                self.last_line = line
            with contextlib.suppress(ValueError, OSError):  # this process's stderr closed at exit
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
        status = self.process.wait()
        with self._lock:
            self.status, on_exit = status, self._on_exit
        if on_exit is not None and self.call_soon is not None:
            with contextlib.suppress(RuntimeError):  # the event loop has ended: nobody waits for it
                self.call_soon(on_exit, status, self.last_line)

    def kill(self) -> None:
        """The process killed at once and everything closed (a server that never served)."""
        self.process.kill()
        self.stop()

    def stop(self, wait_s: float = EXIT_WAIT_S) -> None:
        """Blocking (run it in a thread): the process's exit (killed after ``wait_s``), then the
        sockets, the threads and the directory (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.process.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._watch.join()
        if self._notes is not None:
            self._notes.stop()
        else:
            self._notes_socket.close()
        self._calls.close()
        self.context.term()
        shutil.rmtree(self.dir, ignore_errors=True)
