"""The in-process command line for ``tests/integration/test_cli_fuzz.py``: ``Cli`` runs
``bootstrap.cli.main.main(argv)`` with every work entry point replaced by ``Started``; the
generated flag values; and what is valid for each flag (the README's and the help's ranges,
written out again, so the code under test is not its own oracle)."""

from __future__ import annotations

import argparse
import io
import math
import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st

import bootstrap.cli.args as cli_args
from bootstrap.cli.args import MAX_SEED, int_list
from bootstrap.cli.main import build_parser, main
from bootstrap.cli.plan import FAULTABLE

HUNG_AFTER_S = 5.0


def _hung(signum: int, frame: Any) -> None:
    raise AssertionError(f"still running after {HUNG_AFTER_S:g} s (blocked: a FIFO opened, a read that never ends)")


class Started(BaseException):  # not an error: the work was reached
    """The work an entry point would have started, with what it was given."""

    def __init__(self, where: str, **seen: Any) -> None:
        super().__init__(where)
        self.where, self.seen = where, seen


@dataclass
class Outcome:
    code: int | None  # None: the work was reached (``started``)
    out: str
    err: str
    started: Started | None

    @property
    def lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]


# ---- the command line, in-process -------------------------------------------------------------


def actions(command: str) -> dict[str, argparse.Action]:
    """Every flag of ``command`` by its long option (a positional by its dest)."""
    (group,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    found = [a for a in group.choices[command]._actions if not isinstance(a, argparse._HelpAction)]
    return {(a.option_strings[-1] if a.option_strings else a.dest): a for a in found}


class Cli:
    """``main(argv)`` with the work replaced by ``Started`` and the caches and home in ``tmp``."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp, self.config, self.removed = tmp, None, []
        for name in ("plan", "run", "serve"):
            monkeypatch.setattr(f"bootstrap.cli.{name}.config_from_args", self._config_from_args)
        monkeypatch.setattr("bootstrap.cli.plan.make_tracer_provider", self._reached("plan"))
        monkeypatch.setattr("bootstrap.cli.run.run_command", self._async_reached("stages"))
        monkeypatch.setattr("bootstrap.cli.run.launch_ranks", self._reached("ranks"))
        monkeypatch.setattr("bootstrap.cli.run.needs_launch", lambda config: config.tensor_parallel_size > 1)
        monkeypatch.setattr("bootstrap.cli.serve._serve", self._async_reached("server"))
        monkeypatch.setattr("bootstrap.cli.serve._configure_logging", lambda level: None)
        monkeypatch.setattr("bootstrap.engine.kernels.triton_start.begin_for", lambda *a: False)
        monkeypatch.setattr("bootstrap.cli.trace.command.write_png", lambda lines, out: Path(out))
        monkeypatch.setattr("bootstrap.cli.cache.remove", self._remove)
        monkeypatch.setattr(cli_args, "DEFAULT_PLAN_CACHE", tmp / "plans")
        monkeypatch.setattr("bootstrap.cli.cache.DEFAULT_PLAN_CACHE", tmp / "plans")
        monkeypatch.setattr("bootstrap.cli.cache.default_cache_dir", lambda: tmp / "models")
        monkeypatch.setenv("HOME", str(tmp))
        monkeypatch.delenv("BOOTSTRAP_API_KEY", raising=False)
        monkeypatch.chdir(tmp / "cwd")

    def _config_from_args(self, args: argparse.Namespace) -> Any:
        self.config = cli_args.config_from_args(args)
        return self.config

    def _reached(self, where: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            raise Started(where, config=self.config, args=args, kwargs=kwargs)

        return record

    def _async_reached(self, where: str) -> Any:
        async def record(*args: Any, **kwargs: Any) -> Any:
            raise Started(where, config=self.config, args=args, kwargs=kwargs)

        return record

    def _remove(self, path: Path) -> None:
        assert self.tmp in Path(path).resolve().parents, f"cache clear reached {path}, outside the test's folder"
        self.removed.append(path)

    def __call__(self, argv: list[str]) -> Outcome:
        self.config, started, code = None, None, None
        out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
        err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace", write_through=True)
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = out, err
        previous = signal.signal(signal.SIGALRM, _hung)
        signal.setitimer(signal.ITIMER_REAL, HUNG_AFTER_S)  # a blocking open (a FIFO) fails the example
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's refusal
            code = exc.code
        except Started as exc:
            started = exc
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            sys.stdout, sys.stderr = saved
        return Outcome(
            code,
            out.buffer.getvalue().decode("utf-8", "replace"),
            err.buffer.getvalue().decode("utf-8", "replace"),
            started,
        )


def expand(argv: list[str], tmp: Path) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in argv]


# ---- values -----------------------------------------------------------------------------------

SURROGATES = st.integers(0x80, 0xFF).map(lambda b: bytes([b]).decode("utf-8", "surrogateescape"))
TEXT = st.one_of(
    st.sampled_from(["", " ", "\t", "\n", "é", "日本語", "w4 \udcff", "\udcff", "x" * 300, "-", "--", "a b", "%s"]),
    st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=12),
    st.tuples(st.text(max_size=4), SURROGATES, st.text(max_size=4)).map("".join),
)
INTS = st.one_of(
    st.sampled_from(
        [
            "0",
            "1",
            "-1",
            "2",
            "3",
            "32",
            "2048",
            "2049",
            "4096",
            "4097",
            "65535",
            "65536",
            "1024",
            str(MAX_SEED),
            str(MAX_SEED + 1),
            str(2**64),
            "9" * 5000,
            "٣",
            "²",
            " 7 ",
            "+5",
            "1_0",
            "0x10",
            "1e3",
            "",
            " ",
            "nan",
        ]
    ),
    st.integers(-(2**70), 2**70).map(str),
    st.integers(-5, 70).map(str),
    TEXT,
)
FLOATS = st.one_of(
    st.sampled_from(
        [
            "nan",
            "-nan",
            "inf",
            "-inf",
            "-0.0",
            "0",
            "1",
            "0.5",
            "1e308",
            "1e309",
            "-1",
            "86400",
            "86400.0001",
            "1e-320",
            "٣.٥",
            "1_0",
            "",
            " ",
            "0x1p3",
        ]
    ),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    TEXT,
)
PATHS = st.one_of(
    st.sampled_from(
        [
            "{tmp}/no/such/dir/x",
            "{tmp}/afile",
            "{tmp}/adir",
            "{tmp}/fifo",
            "/dev/null",
            "{tmp}/afile/x",
            "{tmp}/good.jsonl",
            "",
            " ",
            "~",
            "rel/x",
            "d\udcff/x",
            "日本/x.jsonl",
            "/no/such/x",
        ]
    ),
    st.text(st.characters(whitelist_categories=("L", "N")), min_size=1, max_size=8),
)
INT_LISTS = st.one_of(
    st.lists(st.integers(-3, 40), max_size=4).map(lambda v: ",".join(map(str, v))),
    TEXT,
    st.sampled_from([",", "1,,2", "1, 2", "9" * 5000]),
)
FAULTS = st.one_of(
    st.tuples(
        st.sampled_from([*FAULTABLE, "capacity", "nope", ""]),
        st.sampled_from(["oom", "OOM", "x"]),
        st.sampled_from(["", ":1", ":3", ":0", ":-1", ":²", ":٣", ":" + "9" * 5000, ":1:2", ": 1"]),
    ).map(lambda t: f"{t[0]}:{t[1]}{t[2]}"),
    TEXT,
)
HOSTS = st.sampled_from(
    [
        "127.0.0.1",
        "localhost",
        "0.0.0.0",
        "::1",
        "256.0.0.1",
        "1.2.3",
        "",
        " ",
        "::g",
        "\udcff",
        "日本",
        "999.1.1.1",
        "127.0.0.1 ",
        "-1",
    ]
)


def values(command: str, flag: str, action: argparse.Action) -> st.SearchStrategy[str]:
    if flag == "--fault":
        return FAULTS
    if flag == "--host":
        return HOSTS
    if action.choices:
        return st.one_of(st.sampled_from(list(action.choices)), TEXT)
    kinds = {int: INTS, float: FLOATS, Path: PATHS, int_list: INT_LISTS}
    return kinds.get(action.type, TEXT)


def is_switch(action: argparse.Action) -> bool:
    return isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction)


# ---- what is valid (the README's and the help's ranges, written out again) --------------------

DTYPES = {"auto", "float32", "bfloat16", "float16"}
FAULT = re.compile(rf"({'|'.join(FAULTABLE)}):oom(:[0-9]{{1,9}})?")


def _finite(low: float, high: float, low_open: bool = False) -> Any:
    return lambda v: math.isfinite(v) and (v > low if low_open else v >= low) and v <= high


def _api_key(v: str) -> bool:
    return _text(v) and bool(v.strip()) and not any(ord(c) < 0x20 or ord(c) == 0x7F for c in v.strip())


def _origins(v: str) -> bool:
    """Comma-separated ``http[s]://host[:port]``, ASCII, port in [1, 65535], no path."""
    shape = r"https?://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?"
    found = [re.fullmatch(shape, part.strip(), re.IGNORECASE | re.ASCII) for part in v.split(",")]
    return all(f is not None and (f.group(2) is None or 1 <= int(f.group(2)[1:]) <= 65535) for f in found)


def _text(v: str) -> bool:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


RULES: dict[str, Any] = {  # dest -> valid(parsed) given the base argv, or None: not known here
    "max_batch_size": lambda v: 1 <= v <= 2048,  # and <= max_num_tokens (2048)
    "max_num_tokens": lambda v: 32 <= v <= 1_048_576,  # and >= max_batch_size (32)
    "max_seq_len": lambda v: 2 <= v <= 4_194_304,
    "tokens_per_block": lambda v: 1 <= v <= 1024 and v & (v - 1) == 0,
    "free_gpu_memory_fraction": _finite(0.0, 1.0, low_open=True),
    "kv_headroom_bytes": lambda v: v >= 0,
    "max_kv_bytes": lambda v: v >= 1,
    "host_cache_bytes": lambda v: v >= 0,
    "cuda_graph_batch_sizes": lambda v: bool(v) and all(1 <= b <= 32 for b in v),
    "dtype": lambda v: v in DTYPES,
    "kv_cache_dtype": lambda v: v in DTYPES | {"fp8"},
    "device": lambda v: re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", v) is not None,
    "max_tokens": lambda v: v >= 1,
    "temperature": _finite(0.0, math.inf),
    "seed": lambda v: 0 <= v <= MAX_SEED,
    "dist_timeout": _finite(0.0, 86_400.0, low_open=True),
    "port": lambda v: 0 <= v <= 65535,
    "shutdown_timeout": _finite(0.0, 86_400.0),
    "request_trace_ratio": _finite(0.0, 1.0),
    "num_speculative_tokens": lambda v: False,  # alone (one flag at a time): it needs a --draft-model
    "prompt": _text,
    "chat": _text,
    "served_model_name": _text,
    "api_key": _api_key,
    "allowed_origins": _origins,
    "fault": lambda v: all(FAULT.fullmatch(f) and not f.endswith(":0") for f in v),
    "host": lambda v: True if v in ("127.0.0.1", "localhost", "0.0.0.0") else None,
}
RULES_BY_COMMAND: dict[tuple[str, str], Any] = {
    ("plan", "tensor_parallel_size"): lambda v: 1 <= v <= 64,
    ("run", "prompt"): lambda v: _text(v) and v != "",  # an empty prompt is refused as the server refuses it
    ("run", "tensor_parallel_size"): lambda v: v in (1, 3),  # the default model: 9 heads, 3 KV heads
    ("serve", "tensor_parallel_size"): lambda v: True if v == 1 else None if 1 < v <= 64 else False,
    ("plan", "max_kv_tokens"): lambda v: v >= 1,  # the capacity stage checks the rest
    ("run", "max_kv_tokens"): lambda v: v >= 32,  # one block of 32 tokens
    ("serve", "max_kv_tokens"): lambda v: v >= 32,
    ("serve", "backend"): lambda v: v == "native",
    ("trace", "requests"): lambda v: v >= 0,
}


def valid(command: str, action: argparse.Action, parsed: Any) -> bool | None:
    """Whether ``parsed`` (the flag's value as argparse made it) may start the work."""
    rule = RULES_BY_COMMAND.get((command, action.dest), RULES.get(action.dest))
    return None if rule is None else rule(parsed)


def parse(action: argparse.Action, value: str) -> tuple[bool, Any]:
    """(argparse takes it, the value as parsed), with the flag's own type and choices."""
    try:
        parsed = action.type(value) if action.type else value
    except (ValueError, argparse.ArgumentTypeError):
        return False, None
    if action.choices and parsed not in action.choices:
        return False, None
    return True, parsed


HARD = {
    **RULES,
    "max_batch_size": lambda v: 1 <= v <= 4096,
    "max_num_tokens": lambda v: 16 <= v <= 1_048_576,
    "cuda_graph_batch_sizes": lambda v: bool(v) and all(1 <= b <= 4096 for b in v),
    "max_kv_tokens": lambda v: v >= 1,
    "tensor_parallel_size": lambda v: 1 <= v <= 64,
}
