"""The manifest (``bootstrap/backends/trtllm/manifest.json``) against the adapter and the fakes.

Every TensorRT-LLM name and keyword argument the adapter uses must be in the manifest, for each
version it runs on: statically (every ``api.*`` call site in the adapter's source names a manifest
id, and its literal keywords are that id's parameters), and dynamically (running the stages
through every scenario touches every manifest id, each call checked as it is made). The fakes
implement exactly the manifest's callables, with the manifest's signatures.
"""

from __future__ import annotations

import ast
import copy
import inspect
import json
from pathlib import Path

import pytest
from helpers.fake_trtllm import REGISTRY, FakeTrtllm, manifest_signature
from helpers.trtllm_setup import VERSIONS, make_setup

import bootstrap.backends.trtllm as trtllm_package
from bootstrap.backends.trtllm.checked_api import TrtllmApi
from bootstrap.backends.trtllm.manifest import MANIFEST_PATH, Manifest, ManifestError, default_manifest
from bootstrap.pipeline import StageFailed

ADAPTER_DIR = Path(trtllm_package.__file__).parent
API_VERBS = {"call": 0, "load": 0, "constant": 0, "invoke": 1, "get": 1, "put": 1}  # verb -> index of the id


def api_call_sites() -> list[tuple[str, int, str, str, set[str]]]:
    """(file, line, verb, id or id prefix, literal keywords) for every ``api.<verb>(...)`` call."""
    sites = []
    for path in sorted(ADAPTER_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in API_VERBS
            ):
                continue
            owner = node.func.value
            if not (
                (isinstance(owner, ast.Name) and owner.id == "api")
                or (isinstance(owner, ast.Attribute) and owner.attr == "api")
            ):
                continue
            arg = node.args[API_VERBS[node.func.attr]]
            symbol = arg.value if isinstance(arg, ast.Constant) else _fstring_prefix(arg)
            keywords = {k.arg for k in node.keywords if k.arg is not None}
            sites.append((path.name, node.lineno, node.func.attr, symbol, keywords))
    return sites


def _fstring_prefix(node: ast.AST) -> str:
    assert isinstance(node, ast.JoinedStr), f"manifest ids must be literal strings or f-strings, got {ast.dump(node)}"
    first = node.values[0]
    return first.value + "*" if isinstance(first, ast.Constant) else "*"


def test_the_manifest_is_well_formed_data_with_evidence():
    data = json.loads(MANIFEST_PATH.read_text())
    manifest = Manifest(data)  # validates kinds, homes, evidence, versions
    assert set(manifest.versions) == set(VERSIONS)
    assert len(manifest.ids) == len(data["symbols"]) >= 50
    differing = [s["id"] for s in data["symbols"] if "params_by_version" in s or "versions" in s]
    assert {"KvCacheCreator", "instantiate_sampler", "create_py_executor_instance"} <= set(differing)


def test_every_api_call_site_names_a_manifest_id_and_its_keywords():
    manifest = default_manifest()
    sites = api_call_sites()
    assert len(sites) >= 60
    for file, line, verb, symbol, keywords in sites:
        where = f"{file}:{line} api.{verb}({symbol!r})"
        if symbol.endswith("*"):  # f"ResourceManagerType.{name}": some id has that prefix
            assert any(i.startswith(symbol[:-1]) for i in manifest.ids), where
            continue
        versions = [v for v in VERSIONS if manifest.exists(symbol, v)]
        assert versions, f"{where}: not in the manifest"
        for version in versions:
            params = {p.name for p in manifest.symbol(symbol, version).params}
            assert keywords <= params, f"{where}: {sorted(keywords - params)} not parameters in TensorRT-LLM {version}"


def test_the_adapter_reaches_tensorrt_llm_only_through_the_api():
    for path in ADAPTER_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                assert not any(n and n.startswith("tensorrt_llm") for n in names), f"{path.name}:{node.lineno}"


@pytest.mark.parametrize("version", VERSIONS)
def test_the_fakes_implement_exactly_the_manifests_callables(version):
    fake = FakeTrtllm(make_setup(version).device, version)
    manifest = default_manifest()
    callables = {s.id for s in manifest.symbols(version) if s.callable}
    implemented = fake.manifest_ids()
    assert callables <= implemented
    assert implemented - set(manifest.ids) == set()  # no fake claims a name the manifest lacks
    for symbol in manifest.symbols(version):
        if symbol.module is not None and symbol.kind != "attribute":
            assert symbol.id in REGISTRY, symbol.id
            module = fake.import_module(symbol.module)
            assert hasattr(module, symbol.name), symbol.where
    for symbol_id, impl in REGISTRY.items():  # every impl accepts every parameter the manifest gives it
        if symbol_id.startswith("fake:") or not manifest.exists(symbol_id, version):
            continue
        symbol = manifest.symbol(symbol_id, version)
        target = impl.__init__ if inspect.isclass(impl) else impl
        if symbol.params and hasattr(target, "__wrapped__"):
            params = inspect.signature(target.__wrapped__).parameters
            takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
            assert takes_any or {p.name for p in symbol.params} <= set(params), symbol.where


def scenarios(version: str, draft: Path) -> list[dict]:
    runs = [
        dict(),
        dict(draft_model=str(draft)),
        dict(model="gemma-2-9b", max_num_tokens=2048, max_batch_size=16),
        dict(fault=("trtllm/forward", 1)),  # profiling OOM: error responses, re-armed probe
        dict(fault=("trtllm/kv/final", 3)),  # exhausted final build: rollback
    ]
    if version == "main":
        runs.append(dict(model="gemma-2-9b", max_num_tokens=2048, max_batch_size=16, kv_manager="v2"))
    return runs


@pytest.mark.parametrize("version", VERSIONS)
async def test_every_manifest_name_is_used_and_every_use_is_checked(version, draft_config):
    used: set[str] = set()
    for run in scenarios(version, draft_config):
        fault = run.pop("fault", None)
        s = make_setup(version, **run)
        if fault:
            s.device.inject_oom(*fault)
        try:
            await s.pipeline.run()
        except StageFailed as exc:
            assert not isinstance(exc.cause, ManifestError), exc
        finally:
            await s.pipeline.aclose()
        assert s.device.live() == {}
        used |= s.backend.api.used
    expected = {s.id for s in default_manifest().symbols(version)}
    assert expected - used == set(), "manifest names no scenario reaches"
    assert used <= expected


def test_a_renamed_parameter_is_caught_at_the_call(monkeypatch):
    """If TensorRT-LLM renames ``estimating_kv_cache``, the manifest says so and the adapter's call
    fails at the checking layer, naming the symbol, the version and what it takes."""
    data = json.loads(MANIFEST_PATH.read_text())
    renamed = copy.deepcopy(data)
    for entry in renamed["symbols"]:
        if entry["id"] == "KvCacheCreator.build_managers":
            entry["params"] = ["resources", "estimating?"]
    manifest = Manifest(renamed)
    monkeypatch.setattr("bootstrap.backends.trtllm.checked_api.default_manifest", lambda: manifest)
    monkeypatch.setattr("helpers.fake_trtllm.default_manifest", lambda: manifest)
    s = make_setup("main")
    with pytest.raises(StageFailed) as info:
        import anyio

        anyio.run(s.pipeline.run)
    assert info.value.stage == "estimation_build" and isinstance(info.value.cause, ManifestError)
    assert "no parameter 'estimating_kv_cache'" in str(info.value.cause)
    assert "KvCacheCreator.build_managers" in str(info.value.cause)
    anyio.run(s.pipeline.aclose)
    assert s.device.live() == {}


def test_the_fakes_reject_what_tensorrt_llm_would_reject():
    s = make_setup("1.2.1")
    creator_cls = s.fake.import_module("tensorrt_llm._torch.pyexecutor._util").KvCacheCreator
    required = {p.name: None for p in default_manifest().symbol("KvCacheCreator", "1.2.1").params if p.required}
    with pytest.raises(TypeError, match="unexpected keyword argument 'is_disagg'"):
        creator_cls(**required, is_disagg=False)  # 1.2.1 has no is_disagg (a 2026 addition)
    kv_cls = s.fake.import_module("tensorrt_llm.llmapi.llm_args").KvCacheConfig
    with pytest.raises(TypeError, match="use_kv_cache_manager_v2"):
        kv_cls(use_kv_cache_manager_v2=True)
    assert (
        "use_kv_cache_manager_v2"
        not in manifest_signature(default_manifest().symbol("KvCacheConfig", "1.2.1")).parameters
    )


def test_the_api_refuses_unknown_names_and_keywords():
    s = make_setup("main")
    api: TrtllmApi = s.backend.api
    with pytest.raises(ManifestError, match="not in the TensorRT-LLM manifest"):
        api.call("create_py_executor")
    with pytest.raises(ManifestError, match="no parameter 'max_tokens'"):
        api.call("TorchLlmArgs", model="m", max_tokens=1)
    with pytest.raises(ManifestError, match="missing required argument"):
        api.call("_get_mapping")
    with pytest.raises(ManifestError, match="positional"):
        api.call("KvCacheConfig", 0.9)
