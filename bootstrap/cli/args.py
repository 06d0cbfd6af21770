"""The flags the commands share, each with its help and default, and the config they build.

``plan``, ``run`` and ``serve`` take every ``BootstrapConfig`` field as a flag (defaults read
from the config, so the two never disagree); ``run`` and ``serve`` add device, trace and plan
cache flags. ``config_from_args`` validates them once, into the frozen config.
"""

from __future__ import annotations

import argparse
import math
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bootstrap.capacity.presets import preset_names
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.engine.request.prompts import check_text
from bootstrap.paths import file_kind

if TYPE_CHECKING:
    from bootstrap.capacity.shape import ModelShape

DEFAULT_PLAN_CACHE = Path.home() / ".cache" / "executor-bootstrap" / "plans"
DEFAULT_MODEL = BootstrapConfig.model_fields["model"].default
MAX_SEED = 2**63 - 1  # the engine's SamplingParams range (bootstrap.engine.sampling.sampler, which imports torch)
# free text that reaches a tokenizer (prompt, chat), an HTTP header (api_key, allowed_origins) or a JSON body
# (served_model_name)
TEXT_FLAGS = ("prompt", "chat", "api_key", "served_model_name", "allowed_origins")
MAX_SECONDS = 86_400.0  # a day: beyond it a timeout is a typo, and timedelta/asyncio overflow near inf


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default, except where there is none to show (the help then says what
    leaving it out means) or the help names it already; keeps the epilog's table as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
            or "default" in text
            or action.required
        ):
            return text
        return super()._get_help_string(action)


def default_of(field: str) -> Any:
    return BootstrapConfig.model_fields[field].default


def int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_model_arg(parser: argparse.ArgumentParser, command: str) -> None:
    presets = ", ".join(preset_names())
    if command == "plan":
        parser.add_argument(
            "--model", required=True, help=f"a preset ({presets}), a config.json, or a checkpoint directory"
        )
        return
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"a checkpoint directory, a .gguf file, random:<preset|config.json> for real shapes "
        f"with random weights (presets: {presets})",
    )


def speculative_tokens(text: str) -> int | str:
    """``--num-speculative-tokens``: ``auto`` or an integer (its range is the config's to check)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, 16] or auto, got {text!r}") from None


def add_config_args(parser: argparse.ArgumentParser, command: str) -> None:
    """Every ``BootstrapConfig`` field as a flag."""
    add_model_arg(parser, command)
    add = parser.add_argument
    add("--draft-model", help="draft model for two-model speculative decoding (default: none)")
    add(
        "--num-speculative-tokens",
        type=speculative_tokens,
        metavar="N|auto",
        help="with --draft-model: tokens the draft proposes per step, 1-16, or auto: each request as deep as its "
        "recent acceptance pays for, down to none (default 4)",
    )
    add(
        "--tp",
        dest="tensor_parallel_size",
        type=int,
        default=default_of("tensor_parallel_size"),
        help="tensor-parallel size: ranks that each hold 1/N of the heads (must divide the heads and KV heads)",
    )
    add(
        "--dtype",
        default=default_of("dtype"),
        help="weights: auto, float32, bfloat16 or float16; auto is float32 on the CPU, the checkpoint's 16-bit "
        "dtype (else bfloat16) on CUDA",
    )
    add(
        "--kv-cache-dtype",
        default=default_of("kv_cache_dtype"),
        help="KV cache: auto (the weights' dtype), float32, bfloat16, float16 or fp8",
    )
    add(
        "--max-batch-size", type=int, default=default_of("max_batch_size"), help="requests in one forward step, 1..4096"
    )
    add(
        "--max-num-tokens",
        type=int,
        default=default_of("max_num_tokens"),
        help="tokens in one forward step (what profiling runs), max_batch_size..1048576",
    )
    add(
        "--max-seq-len",
        type=int,
        help="prompt + output tokens per request (default: the model's max_position_embeddings)",
    )
    add(
        "--tokens-per-block",
        type=int,
        default=default_of("tokens_per_block"),
        help="tokens per KV cache block, a power of two in 1..1024",
    )
    add(
        "--free-gpu-memory-fraction",
        type=float,
        help="TensorRT-LLM's rule: KV gets this share (0..1] of the memory left after the measured peak "
        "(default: the backend's headroom where it has one, the native engine on CUDA; else 0.9)",
    )
    add(
        "--kv-headroom-bytes",
        type=int,
        help="KV gets all the memory left after the measured peak but this many bytes (default: see "
        "--free-gpu-memory-fraction; give one of the two)",
    )
    add("--max-kv-bytes", type=int, help="cap on the KV pool in bytes (default: no cap)")
    add("--max-kv-tokens", type=int, help="cap on the KV pool in tokens (default: no cap)")
    add(
        "--host-cache-bytes",
        type=int,
        default=default_of("host_cache_bytes"),
        help="host (CPU) KV tier in bytes, 0 for none",
    )
    add(
        "--plan-cache",
        type=Path,
        help="directory of cached plans (default: none for plan; run and serve use "
        f"{DEFAULT_PLAN_CACHE} unless --no-plan-cache)",
    )
    add(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="do not capture decode steps as CUDA graphs; the warmup stage is then skipped, reason disabled "
        "(default: captured on a CUDA device)",
    )
    add(
        "--no-prefix-cache",
        dest="prefix_caching",
        action="store_false",
        help="do not reuse the KV blocks of a prompt prefix computed before (default: reused, per cache_salt)",
    )
    add(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="read each step's tokens before the next step is launched (default: the next step is launched "
        "first, its host work overlapping the device's; CUDA only)",
    )
    add(
        "--quantization",
        choices=("fp8",),
        help="fp8: quantize a 16-bit checkpoint's attention and MLP projections to FP8 at load, one scale per "
        "output row (default: the checkpoint's own weights; an FP8 checkpoint loads as it is)",
    )
    add(
        "--cuda-graph-batch-sizes",
        type=int_list,
        metavar="N,N,...",
        help="batch sizes to capture as CUDA graphs (default: 1,2,4,8, then multiples of 8 up to max_batch_size)",
    )
    add_backend_args(parser)


def add_backend_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--backend",
        choices=("native", "trtllm"),
        default=default_of("backend"),
        help="whose executor and KV pricing: native, or trtllm (TensorRT-LLM's PyExecutor)",
    )
    add(
        "--kv-manager",
        choices=("auto", "v1", "v2"),
        default=default_of("kv_manager"),
        help="TensorRT-LLM KV cache manager (--backend trtllm); auto is what TensorRT-LLM picks (V1)",
    )


def add_build_args(parser: argparse.ArgumentParser) -> None:
    """What ``run`` and ``serve`` both take beyond the config: device, trace, plan cache."""
    add = parser.add_argument
    add("--device", default="auto", help="auto (CUDA when torch sees it, else the CPU), cpu, cuda or cuda:N")
    add("--trace-file", type=Path, help="write finished spans as JSON Lines, overwriting the file (default: none)")
    add("--otlp", action="store_true", help="also export spans over OTLP (needs the otlp extra)")
    add("--no-plan-cache", action="store_true", help=f"profile every start (default cache: {DEFAULT_PLAN_CACHE})")
    add(
        "--dist-timeout",
        type=float,
        default=600.0,
        help="with --tp N: seconds any collective waits for a rank before it names the rank that stopped answering",
    )


def config_from_args(args: argparse.Namespace) -> BootstrapConfig:
    """The validated config; ``ConfigError`` naming each bad field and its allowed range (all on
    one line), or a command's text or file flag that cannot be used (``check_flags``)."""
    check_flags(args)
    values = {k: v for k, v in vars(args).items() if k in BootstrapConfig.model_fields and v is not None}
    if getattr(args, "no_plan_cache", False):
        values.pop("plan_cache", None)
    elif args.command in ("run", "serve"):
        values.setdefault("plan_cache", DEFAULT_PLAN_CACHE)
    return BootstrapConfig.parse(**values)


def check_flags(args: argparse.Namespace) -> None:
    """What ``plan``, ``run`` and ``serve`` take beyond the config, before any work: text UTF-8
    cannot encode (``TEXT_FLAGS``: an argv byte that is not UTF-8 arrives as a lone surrogate),
    and a ``--trace-file`` that is a FIFO (opening it to write blocks)."""
    check_values_given(args)
    for field in TEXT_FLAGS:
        check_text(field, getattr(args, field, None))
    trace = getattr(args, "trace_file", None)
    if trace is not None:
        check_output_file("trace_file", trace)


def check_values_given(args: argparse.Namespace, lists: tuple[str, ...] = ("fault", "files")) -> None:
    """argparse (3.11) reads ``--flag=--`` as the value ``[]``, whatever the flag's type: refused
    naming the field, as an empty value would be. ``lists``: the flags whose value is a list."""
    for field, value in vars(args).items():
        if value == [] and field not in lists:
            raise ConfigError(f"{field}: expected a value after '=' (got '--')")


def check_output_file(field: str, path: Path) -> None:
    """``ConfigError`` when ``path`` is a FIFO (links followed): opening it to write blocks until
    a reader comes, before any message. A device (``/dev/null``, ``/dev/full``) is written as
    asked; a directory is refused by the writer's open."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # absent (created later), or not ours to look into: the writer says why
        return
    if stat.S_ISFIFO(mode):
        raise ConfigError(f"{field}: cannot write to {path}: {file_kind(mode)}, not a regular file")


def check_positive(**values: int) -> None:
    """A flag that must be >= 1, named as its field."""
    for field, value in values.items():
        if value < 1:
            raise ConfigError(f"{field}: must be >= 1 (got {value})")


def check_number(
    field: str,
    value: float,
    low: float,
    high: float = math.inf,
    *,
    low_open: bool = False,
    unit: str = "",
    note: str = "",
) -> None:
    """A numeric flag in ``[low, high]`` (``(low, high]`` with ``low_open``), finite: NaN and inf
    pass argparse's ``float`` and fail only once the bootstrap ran (a NaN deadline at SIGTERM)."""
    above = value > low if low_open else value >= low
    if math.isfinite(value) and above and value <= high:
        return
    bound = "inf)" if high == math.inf else f"{high:g}]"
    where = f"{'(' if low_open else '['}{low:g}, {bound}"
    raise ConfigError(
        f"{field}: must be {'>' if low_open else '>='} {low:g}{unit} (got {value!r}); allowed: a finite "
        f"number in {where}{note}"
    )


def check_dist_timeout(seconds: float) -> None:
    check_number("dist_timeout", seconds, 0.0, MAX_SECONDS, low_open=True, unit=" seconds")


def check_run_values(args: argparse.Namespace) -> None:
    """``run``'s own flags, before any stage: each one names the flag and its allowed range."""
    check_positive(max_tokens=args.max_tokens)
    check_number("temperature", args.temperature, 0.0, note=", 0 = greedy")
    check_dist_timeout(args.dist_timeout)
    if args.seed is not None and not 0 <= args.seed <= MAX_SEED:
        raise ConfigError(f"seed: must be an integer in [0, {MAX_SEED}] (got {args.seed})")


def check_kv_tokens(config: BootstrapConfig) -> None:
    """``max_kv_tokens`` against what the ``capacity`` stage will demand (``plan_capacity``: one KV
    block, one request of ``max_seq_len``), with the figures known before the stages, so ``run``
    and ``serve`` refuse it with exit 2 as ``bootstrap plan`` does instead of failing profiling
    (a probe capped below its own dummy request). A ``max_seq_len`` taken from the model is
    checked by the backend in ``resolve_classes``."""
    if config.max_kv_tokens is None:
        return
    block = config.tokens_per_block
    need, what = block, f"one KV block (tokens_per_block={block})"
    if config.max_seq_len is not None:
        need = -(-config.max_seq_len // block) * block
        what = f"one request of max_seq_len={config.max_seq_len} ({need // block} blocks of {block})"
    if config.max_kv_tokens < need:
        raise ConfigError(
            f"max_kv_tokens: must be >= {need} to hold {what} (got {config.max_kv_tokens}); "
            "raise --max-kv-tokens or leave it out"
        )


def check_model_limits(config: BootstrapConfig) -> None:
    """What ``resolve_classes`` checks against the model's config.json (``check_config``:
    ``max_seq_len``, the draft, ``--tp``'s split), here before torch is imported (seconds) where
    the shape is on hand without the engine (``shape_on_hand``). Other sources, and a config.json
    that does not parse, are the stage's."""
    from bootstrap.capacity.shape import ModelConfigError
    from bootstrap.stages.resolve_classes import check_config

    try:
        shape = shape_on_hand(config.model, random=True)
        draft = shape_on_hand(config.draft_model, random=True) if config.draft_model else None
    except (ModelConfigError, OSError):
        return
    if shape is not None and (draft is not None or not config.draft_model):
        check_config(config, shape, draft)


def shape_on_hand(model: str, *, random: bool) -> ModelShape | None:
    """The shape of ``model`` read without the engine: the default model's preset, a checkpoint
    directory's config.json, with ``random`` a ``random:`` spec; None for other sources.
    ``ModelConfigError`` when a config.json that is there does not parse."""
    from bootstrap.capacity.config_json import shape_from_path
    from bootstrap.capacity.presets import preset_shape, resolve_model_shape

    if model == BootstrapConfig.model_fields["model"].default:
        return preset_shape(model)
    if random and model.startswith("random:"):
        return resolve_model_shape(model)
    if Path(model).expanduser().is_dir():
        return shape_from_path(model)
    return None
