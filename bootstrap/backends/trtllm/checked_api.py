"""The checking layer: the only way the adapter reaches TensorRT-LLM.

Every module-level class or function, method call, attribute read and write goes through
``TrtllmApi`` by manifest id (``api.call("KvCacheCreator", model_engine=...)``,
``api.invoke(creator, "KvCacheCreator.build_managers", resources=..., ...)``). Each is checked
against the manifest for the installed version before TensorRT-LLM sees it, so a parameter that
TensorRT-LLM renames fails here with the symbol, the version and the names it takes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from types import ModuleType
from typing import Any

from bootstrap.backends.trtllm.manifest import Manifest, ManifestError, Symbol, default_manifest
from bootstrap.pipeline.telemetry import MissingExtra

INSTALL_HINT = (
    "the trtllm backend needs TensorRT-LLM (1.2.1, or 1.3+ from main) and a CUDA driver: "
    "pip install 'executor-bootstrap[trtllm]' (the tensorrt-llm package fetches its wheel from NVIDIA's index; "
    "importing it needs libcuda.so.1). `bootstrap plan --backend trtllm` needs neither: it prices on a simulated GPU"
)

ImportModule = Callable[[str], ModuleType]


def version_profile(raw: str) -> str:
    """The manifest profile for a ``tensorrt_llm.__version__``: ``1.2.x`` -> ``1.2.1``, later -> ``main``."""
    match = re.match(r"(\d+)\.(\d+)", raw)
    release = (int(match.group(1)), int(match.group(2))) if match else None
    if release == (1, 2):
        return "1.2.1"
    if release is not None and release > (1, 2):
        return "main"
    raise MissingExtra(f"TensorRT-LLM {raw} is not supported: the trtllm backend supports 1.2.x and 1.3+ (main)")


class TrtllmApi:
    def __init__(self, import_module: ImportModule, manifest: Manifest | None = None) -> None:
        self._import = import_module
        self._modules: dict[str, ModuleType] = {}
        self.manifest = manifest or default_manifest()
        self.used: set[str] = set()  # manifest ids this adapter touched
        self.version = version_profile(self._installed_version())

    def has(self, symbol_id: str) -> bool:
        """Whether the installed version has ``symbol_id`` (e.g. a V2-only feature)."""
        return self.manifest.exists(symbol_id, self.version)

    def load(self, symbol_id: str) -> Any:
        """A module-level class or function object, not called."""
        symbol = self._symbol(symbol_id)
        if symbol.module is None:
            raise ManifestError(f"{symbol.where}: is a member of {symbol.owner}, not a module-level name")
        return getattr(self._module(symbol.module), symbol.name)

    def call(self, symbol_id: str, *args: Any, **kwargs: Any) -> Any:
        """Call a module-level class or function, arguments checked first."""
        self._symbol(symbol_id).check_call(args, kwargs)
        return self.load(symbol_id)(*args, **kwargs)

    def invoke(self, obj: Any, symbol_id: str, *args: Any, **kwargs: Any) -> Any:
        """Call method ``symbol_id`` of ``obj``, arguments checked first."""
        symbol = self._member(symbol_id)
        symbol.check_call(args, kwargs)
        return getattr(obj, symbol.name)(*args, **kwargs)

    def get(self, obj: Any, symbol_id: str) -> Any:
        return getattr(obj, self._attribute(symbol_id).name)

    def put(self, obj: Any, symbol_id: str, value: Any) -> None:
        setattr(obj, self._attribute(symbol_id).name, value)

    def constant(self, symbol_id: str) -> Any:
        """A class-level attribute such as an enum member, e.g. ``ResourceManagerType.KV_CACHE_MANAGER``."""
        symbol = self._attribute(symbol_id)
        return getattr(self.load(symbol.owner), symbol.name)

    def _installed_version(self) -> str:
        symbol = self.manifest.symbol("tensorrt_llm.__version__", "main")  # the same place in every version
        self.used.add(symbol.id)
        return getattr(self._module(symbol.module), symbol.name)

    def _symbol(self, symbol_id: str) -> Symbol:
        symbol = self.manifest.symbol(symbol_id, self.version)
        self.used.add(symbol_id)
        return symbol

    def _member(self, symbol_id: str) -> Symbol:
        symbol = self._symbol(symbol_id)
        if symbol.owner is None or symbol.kind != "method":
            raise ManifestError(f"{symbol.where}: is not a method")
        return symbol

    def _attribute(self, symbol_id: str) -> Symbol:
        symbol = self._symbol(symbol_id)
        if symbol.kind != "attribute":
            raise ManifestError(f"{symbol.where}: is a {symbol.kind}, not an attribute")
        return symbol

    def _module(self, name: str) -> ModuleType:
        if name not in self._modules:
            try:
                self._modules[name] = self._import(name)
            except (ImportError, OSError) as exc:  # OSError: libcuda.so.1 missing under the bindings
                raise MissingExtra(f"{INSTALL_HINT} (importing {name} failed: {exc})") from exc
        return self._modules[name]
