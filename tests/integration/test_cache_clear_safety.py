"""``bootstrap cache clear`` pointed at directories that hold more than the caches wrote: the
working directory (``--plan-cache .``), ``~/.cache``, a link to a directory, a file. Whatever the
directory, only the caches' own entries go (recognised by place, name and content), every other
file survives byte for byte, no link is followed, no directory the caches did not create is
removed, and the command says what it removed. The command runs as a user runs it, in a
subprocess; the plan it clears is one a real ``bootstrap plan`` stored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bootstrap.cli.cache import plan_text
from bootstrap.engine.sources.model_cache import SOURCE_FILE, size_text

ROOT = Path(__file__).resolve().parents[2]
KEY = "0123456789abcdef0123456789abcdef"
CONVERTED = "gguf/tiny-0123456789abcdef"  # where conversions put a tiny.gguf: <stem>-<16 hex digits>

# Files no cache wrote, several named as the caches name their own entries.
UNRELATED = {
    "settings.json": b'{"user": 1}\n',
    f"{KEY}.json": b'{"fingerprint": "not a plan"}',  # a plan's name, other content
    "fedcba9876543210fedcba9876543210.json": b'{"fingerprint": "00000000000000000000000000000000"}',  # another key
    "tmpabcd1234.tmp": b"a draft",  # the name an older store gave its temporary file
    f"{KEY}.abcd1234.tmp": b"not a plan either",
    "notes.tmp": b"mine",
    "sub/deeper/settings.json": b"[]",
    f"sub/{'a' * 32}.json": json.dumps({"fingerprint": "a" * 32}).encode(),  # a plan's form, in a subfolder
    "pip/http/cache.bin": os.urandom(4096),
    "gguf/mine/weights.bin": b"w" * 1000,  # the model cache's folder name, not its entries
    "gguf/.git/config": b"[core]\n",
    "gguf/model-0123456789abcdef/notes.txt": b"a conversion's name, nothing of a conversion",
    "downloads/SmolLM2-135M-Instruct.Q4_1.gguf": b"the default model's name, not a GGUF",
    "smollm2-135m-instruct-q4_1/readme.txt": b"the default checkpoint's name, not a checkpoint",
}


def cli(*argv: str, cwd: Path = ROOT, home: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"HOME": str(home)} if home else {})}
    return subprocess.run(
        [sys.executable, "-m", "bootstrap.cli", *argv],
        check=False,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def write(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def snapshot(*roots: Path) -> dict[str, tuple]:
    """Every path under ``roots`` (links not followed): a file's bytes, a link's target, a dir."""
    seen = {}
    for root in roots:
        for folder, dirs, files in os.walk(root):
            for name in dirs + files:
                path = Path(folder, name)
                if path.is_symlink():
                    seen[str(path)] = ("link", os.readlink(path))
                else:
                    seen[str(path)] = ("dir",) if path.is_dir() else ("file", path.read_bytes())
    return seen


def store_a_plan(directory: Path) -> Path:
    """The plan a real start stores in ``directory`` (the simulated GPU: no torch)."""
    done = cli("plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--plan-cache", str(directory))
    assert done.returncode == 0, done.stderr
    (plan,) = set(directory.glob("*.json")) - {directory / name for name in UNRELATED}
    return plan


def own_conversion(root: Path) -> Path:
    """A converted .gguf file as ``conversions`` lays it out (its config, weights, source.json)."""
    converted = root / CONVERTED
    write(
        converted,
        {
            "config.json": b"{}",
            "model.safetensors": b"s" * 5000,
            SOURCE_FILE: json.dumps({"gguf": {"path": "/models/tiny.gguf"}}).encode(),
        },
    )
    return converted


@pytest.mark.parametrize("named", ["as .", "as ~/.cache", "through a link"])
def test_clear_removes_only_its_own_entries_from_a_directory_full_of_other_files(tmp_path, named):
    home, work = tmp_path / "home", tmp_path / "work"
    target = home / ".cache" if named == "as ~/.cache" else work
    write(target, UNRELATED)
    (tmp_path / "link").symlink_to(target)
    given = {"as .": ".", "as ~/.cache": "~/.cache", "through a link": str(tmp_path / "link")}[named]
    kept = snapshot(tmp_path)
    plan, converted = store_a_plan(target), own_conversion(target)
    size = size_text(plan.stat().st_size)
    setup = plan_text(plan)  # read before the clear, which names each plan it removed with it
    assert setup.startswith("llama-3.1-8b: max_seq_len ")
    done = cli("cache", "clear", "--plan-cache", given, "--model-cache", given, cwd=target, home=home)
    assert done.returncode == 0, done.stderr
    shown = target if named == "as ~/.cache" else given
    assert done.stdout.splitlines() == [
        f"removed 1 cached plan(s) from {shown}: {size}",
        f"  {size:>10}  {plan.name}  {setup}",
        f"removed 1 model cache entries from {shown}: 5.0 kB",
        f"      5.0 kB  {CONVERTED}  converted from /models/tiny.gguf (that file is gone)",
    ]
    assert snapshot(tmp_path) == kept  # every other file byte for byte, every folder, the link
    assert not plan.exists() and not converted.exists()


def test_links_in_a_cache_are_never_followed(tmp_path):
    """Links named as the caches name their entries and folders, to what looks like the caches'
    own content elsewhere: the links stay, and so does everything they point to."""
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    write(
        elsewhere,
        {
            "plan.json": json.dumps({"fingerprint": KEY}).encode(),
            "downloads/SmolLM2-135M-Instruct.Q4_1.gguf": b"GGUF" + b"q" * 1000,
            "conversions/tiny-0123456789abcdef/config.json": b"{}",
            "conversions/tiny-0123456789abcdef/model.safetensors": b"s" * 1000,
            "checkpoint/config.json": b"{}",
            "checkpoint/model.safetensors": b"s" * 1000,
            "staging/model.safetensors": b"s" * 1000,
        },
    )
    cache.mkdir()
    links = {
        f"{KEY}.json": "plan.json",
        "downloads": "downloads",
        "gguf": "conversions",
        "smollm2-135m-instruct-q4_1": "checkpoint",
        ".smollm2-135m-instruct-q4_1.abcd1234": "staging",
    }
    for name, target in links.items():
        (cache / name).symlink_to(elsewhere / target)
    kept = snapshot(tmp_path)
    done = cli("cache", "clear", "--plan-cache", str(cache), "--model-cache", str(cache))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"removed 0 cached plan(s) from {cache}: 0.0 MB",
        f"removed 0 model cache entries from {cache}: 0.0 MB",
    ]
    assert snapshot(tmp_path) == kept


def test_a_plan_directory_goes_only_when_a_start_created_it(tmp_path):
    mine = tmp_path / "mine"  # made by the user before the first start
    mine.mkdir()
    created = tmp_path / "new" / "plans"  # made by the first start
    store_a_plan(mine), store_a_plan(created)
    for directory in (mine, created):
        done = cli("cache", "clear", "--plans", "--plan-cache", str(directory))
        assert done.returncode == 0 and done.stdout.startswith(f"removed 1 cached plan(s) from {directory}: ")
    assert mine.is_dir() and list(mine.iterdir()) == []
    assert not created.exists() and (tmp_path / "new").is_dir()  # its parent was not the cache's


@pytest.mark.parametrize("flag", ["--plan-cache", "--model-cache"])
def test_a_cache_path_that_is_a_file_is_refused_and_kept(tmp_path, flag):
    path = tmp_path / "a-file.json"
    path.write_bytes(b'{"fingerprint": "kept"}')
    done = cli(
        "cache",
        "clear",
        flag,
        str(path),
        "--model-cache" if flag == "--plan-cache" else "--plan-cache",
        str(tmp_path / "absent"),
    )
    assert done.returncode == 2 and done.stderr == f"bootstrap: {flag}: {path} is a file, not a cache directory\n"
    assert path.read_bytes() == b'{"fingerprint": "kept"}'
