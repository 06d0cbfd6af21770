"""Fakes of the TensorRT-LLM objects the trtllm adapter uses, generated from its manifest.

``FakeTrtllm(device, version)`` is one fake installation: ``import_module`` serves the modules
the manifest names, holding exactly the manifest's symbols for that version. Every fake callable
(class constructor, function, method) is wrapped by ``checked(symbol_id)``, which binds the
arguments against the signature the manifest gives for that version (Python's own binding: an
unknown keyword or a missing required argument is the ``TypeError`` real code would raise), so
the fakes cannot accept a call TensorRT-LLM would reject. Behaviour follows TensorRT-LLM's
source (cited per class); memory is allocated on a ``FakeDevice`` and, like torch tensors,
released when the owning object is collected, or explicitly where TRT releases explicitly.
"""

from __future__ import annotations

import enum
import functools
import inspect
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

from bootstrap.backends.trtllm.manifest import Manifest, Symbol, default_manifest
from bootstrap.devices import FakeDevice

VERSIONS = {"1.2.1": "1.2.1", "main": "1.3.0rc13"}  # profile -> what tensorrt_llm.__version__ says
REGISTRY: dict[str, Any] = {}  # manifest id -> fake class or function (filled by the modules below)
_OPTIONAL = object()


def manifest_signature(symbol: Symbol) -> inspect.Signature:
    params = [
        inspect.Parameter(
            p.name,
            inspect.Parameter.KEYWORD_ONLY if p.keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=inspect.Parameter.empty if p.required else _OPTIONAL,
        )
        for p in symbol.params
    ]
    return inspect.Signature(params)


def checked(symbol_id: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Bind every call against the manifest's signature for the installed fake version."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(owner: Any, *args: Any, **kwargs: Any) -> Any:
            trt: FakeTrtllm = owner if isinstance(owner, FakeTrtllm) else owner._trt
            manifest_signature(trt.manifest.symbol(symbol_id, trt.version)).bind(*args, **kwargs)
            return fn(owner, *args, **kwargs)

        wrapper.manifest_id = symbol_id  # type: ignore[attr-defined]
        return wrapper

    return decorate


def export(symbol_id: str) -> Callable[[Any], Any]:
    """Register a fake class or function as the module-level ``symbol_id`` (``fake:Name`` for
    internal classes that TensorRT-LLM code creates itself, such as the KV managers)."""

    def register(obj: Any) -> Any:
        REGISTRY[symbol_id] = obj
        return obj

    return register


class Allocation:
    """Bytes on the fake device, released once: explicitly, or when ``owner`` is collected."""

    def __init__(self, trt: FakeTrtllm, nbytes: int, tag: str, owner: Any) -> None:
        self.nbytes, self.tag = nbytes, tag
        self._release = weakref.finalize(owner, trt.device.free, trt.device.allocate(nbytes, tag))

    @property
    def live(self) -> bool:
        return self._release.alive

    def release(self) -> None:
        self._release()


class FakeTrtllm:
    """One fake TensorRT-LLM installation on ``device``, speaking manifest ``version``."""

    def __init__(self, device: FakeDevice, version: str = "main", manifest: Manifest | None = None) -> None:
        self.device, self.version = device, version
        self.manifest = manifest or default_manifest()
        self.log: list[str] = []  # TensorRT-LLM-level events, for tests to read
        self.classes = {name: _bound(cls, self) for name, cls in _classes().items()}
        self.modules = self._modules()

    def cls(self, symbol_id: str) -> type:
        return self.classes[symbol_id]

    def import_module(self, name: str) -> ModuleType:
        if name not in self.modules:
            raise ModuleNotFoundError(f"No module named {name!r} (fake TensorRT-LLM {self.version})")
        return self.modules[name]

    def allocate(self, nbytes: int, tag: str, owner: Any) -> Allocation:
        return Allocation(self, nbytes, tag, owner)

    def _modules(self) -> dict[str, ModuleType]:
        modules = {"tensorrt_llm": ModuleType("tensorrt_llm")}
        modules["tensorrt_llm"].__version__ = VERSIONS[self.version]
        for symbol in self.manifest.symbols(self.version):
            if symbol.module is None or symbol.kind == "attribute":
                continue
            module = modules.setdefault(symbol.module, ModuleType(symbol.module))
            setattr(module, symbol.name, self._exported(symbol.id))
        return modules

    def manifest_ids(self) -> set[str]:
        """Every manifest id some fake implements (module-level exports and checked methods)."""
        ids = {i for i in REGISTRY if not i.startswith("fake:")}
        for cls in self.classes.values():
            for base in cls.__mro__[1:-1]:
                members = [getattr(m, "__func__", m) for m in vars(base).values()]
                ids |= {m.manifest_id for m in members if hasattr(m, "manifest_id")}
        return ids

    def _exported(self, symbol_id: str) -> Any:
        obj = REGISTRY[symbol_id]
        return self.classes[symbol_id] if isinstance(obj, type) else functools.partial(obj, self)


def _bound(cls: type, trt: FakeTrtllm) -> type:
    """A subclass of ``cls`` that knows its installation (enums are shared: they hold no state)."""
    return cls if issubclass(cls, enum.Enum) else type(cls.__name__, (cls,), {"_trt": trt})


def _classes() -> dict[str, type]:
    return {symbol_id: obj for symbol_id, obj in REGISTRY.items() if isinstance(obj, type)}


from helpers.fake_trtllm import creator, engine, executor, kv, llm_args  # noqa: E402,F401  (they fill REGISTRY)
