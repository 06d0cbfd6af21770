"""The manifest (``manifest.json``): every TensorRT-LLM name the adapter uses, as data.

``Manifest.load()`` reads it; ``manifest.symbol(id, version)`` is one name as that TensorRT-LLM
version spells it; ``Symbol.check_call(args, kwargs)`` rejects a call whose positional count or
keyword names the manifest does not list for that version (a renamed parameter is caught here,
before anything reaches TensorRT-LLM). Parameter notation: ``name`` required, ``name?`` has a
default, ``*`` keyword-only from there on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

MANIFEST_PATH = Path(__file__).with_name("manifest.json")
KINDS = ("class", "function", "method", "attribute")


class ManifestError(TypeError):
    """A call or name the manifest does not allow for the TensorRT-LLM version in use."""


@dataclass(frozen=True)
class Param:
    name: str
    required: bool
    keyword_only: bool


@dataclass(frozen=True)
class Symbol:
    """One TensorRT-LLM name for one version: where it lives and, if callable, its parameters."""

    id: str
    kind: str
    name: str
    version: str
    module: str | None = None  # top-level symbols
    owner: str | None = None  # methods and attributes: the class (or protocol) they belong to
    params: tuple[Param, ...] = ()

    @property
    def callable(self) -> bool:
        return self.kind in ("class", "function", "method")

    def check_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise `ManifestError` unless ``(*args, **kwargs)`` fits this version's parameters."""
        if not self.callable:
            raise ManifestError(f"{self.where}: is a {self.kind}, not callable")
        positional = [p for p in self.params if not p.keyword_only]
        if len(args) > len(positional):
            raise ManifestError(f"{self.where}: takes {len(positional)} positional arguments, {len(args)} given")
        known = {p.name for p in self.params}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ManifestError(f"{self.where}: no parameter {', '.join(map(repr, unknown))}; it takes {sorted(known)}")
        given = {p.name for p in positional[: len(args)]} | set(kwargs)
        twice = sorted({p.name for p in positional[: len(args)]} & set(kwargs))
        if twice:
            raise ManifestError(f"{self.where}: {', '.join(twice)} given positionally and by keyword")
        missing = [p.name for p in self.params if p.required and p.name not in given]
        if missing:
            raise ManifestError(f"{self.where}: missing required argument(s) {', '.join(missing)}")

    @property
    def where(self) -> str:
        home = self.module if self.module else self.owner
        return f"TensorRT-LLM {self.version} {home}.{self.name}"


class Manifest:
    def __init__(self, data: dict[str, Any]) -> None:
        self.versions: dict[str, dict[str, Any]] = data["versions"]
        self._entries: dict[str, dict[str, Any]] = {e["id"]: e for e in data["symbols"]}
        for entry in self._entries.values():
            _validate_entry(entry, self.versions)

    @classmethod
    def load(cls, path: Path = MANIFEST_PATH) -> Manifest:
        return cls(json.loads(path.read_text(encoding="utf-8")))

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def exists(self, symbol_id: str, version: str) -> bool:
        entry = self._entries.get(symbol_id)
        return entry is not None and version in entry.get("versions", self.versions)

    def symbol(self, symbol_id: str, version: str) -> Symbol:
        entry = self._entries.get(symbol_id)
        if entry is None:
            raise ManifestError(f"{symbol_id!r} is not in the TensorRT-LLM manifest ({MANIFEST_PATH.name})")
        if not self.exists(symbol_id, version):
            raise ManifestError(f"{symbol_id!r} does not exist in TensorRT-LLM {version}")
        spec = entry.get("params_by_version", {}).get(version, entry.get("params", []))
        return Symbol(
            id=symbol_id,
            kind=entry["kind"],
            name=entry["name"],
            version=version,
            module=entry.get("module"),
            owner=entry.get("owner"),
            params=parse_params(spec),
        )

    def symbols(self, version: str) -> tuple[Symbol, ...]:
        return tuple(self.symbol(i, version) for i in self._entries if self.exists(i, version))


def parse_params(spec: list[str]) -> tuple[Param, ...]:
    params, keyword_only = [], False
    for item in spec:
        if item == "*":
            keyword_only = True
            continue
        params.append(Param(item.rstrip("?"), required=not item.endswith("?"), keyword_only=keyword_only))
    return tuple(params)


def _validate_entry(entry: dict[str, Any], versions: dict[str, Any]) -> None:
    where = entry.get("id", "<no id>")
    if entry.get("kind") not in KINDS:
        raise ValueError(f"manifest {where}: kind must be one of {KINDS}, got {entry.get('kind')!r}")
    if bool(entry.get("module")) == bool(entry.get("owner")):
        raise ValueError(f"manifest {where}: give exactly one of module (top level) and owner (member)")
    if not entry.get("evidence"):
        raise ValueError(f"manifest {where}: every entry says what was read (evidence)")
    for version in [*entry.get("versions", []), *entry.get("params_by_version", {})]:
        if version not in versions:
            raise ValueError(f"manifest {where}: unknown version {version!r}")


@cache
def default_manifest() -> Manifest:
    return Manifest.load()
