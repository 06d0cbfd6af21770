"""The PNG of ``bootstrap trace --png``: one panel per timeline on one time axis; needs
matplotlib (the ``plot`` extra). The path is checked before anything is drawn. A timeline is
``bootstrap.cli.trace.timeline.Timeline`` (its ``source``, ``bars`` and ``end_s``)."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bootstrap.config import ConfigError
from bootstrap.paths import file_kind
from bootstrap.pipeline.telemetry import MissingExtra

INSIDE_FROM = 0.6  # a bar ending past this share of its panel's width has its label end at the bar's end
PNG_COLORS = {"ok": "#2e7d32", "failed": "#c62828", "cancelled": "#ef6c00", "refused": "#8e24aa", "skipped": "#9e9e9e"}


def printable(text: str) -> str:
    """``text`` as any terminal or file takes it: a lone surrogate (a JSON ``\\ud800`` escape, a
    path's undecodable byte) becomes ``?`` instead of failing the write."""
    return text.encode("utf-8", "replace").decode("utf-8")


def special_kind(path: Path) -> str | None:
    """What ``path`` is when it exists and is no regular file (links followed), else None."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # absent, or not ours to look into: the open says why
        return None
    if stat.S_ISREG(mode):
        return None
    return "a directory" if stat.S_ISDIR(mode) else file_kind(mode)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingExtra("the PNG timeline needs matplotlib: pip install 'executor-bootstrap[plot]'") from exc
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def check_png_path(out: Path) -> None:
    """Before any rendering: ``out`` (and its folder) can be created and written. A file that
    did not exist is removed again, so a later failure leaves nothing behind."""
    special = special_kind(out)
    if special == file_kind(stat.S_IFIFO):  # its open would block until a reader comes
        raise ConfigError(
            f"png: cannot write {printable(str(out))!r} ({special}, not a regular file); "
            "pass a file in a writable folder"
        )
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        existed = Path(out).exists()
        with open(out, "ab"):
            pass
        if not existed:
            Path(out).unlink()
    except OSError as exc:
        raise ConfigError(
            f"png: cannot write {str(out)!r} ({exc.strerror or exc}); pass a file in a writable folder"
        ) from None


def write_png(lines: Sequence[Any], out: Path) -> Path:
    """One panel per timeline, stacked, on one time axis (seconds); bars coloured by outcome.
    Always PNG, whatever ``out`` ends with; labels are drawn as written (no mathtext)."""
    plt = _pyplot()
    fig, _ = figure(lines)
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=120, format="png")
    except OSError as exc:
        raise ConfigError(f"png: cannot write {str(out)!r} ({exc.strerror or exc})") from None
    finally:
        plt.close(fig)
    return Path(out)


def figure(lines: Sequence[Any]) -> tuple[Any, list[Any]]:
    """The laid-out figure of ``write_png`` and every bar's label in it."""
    plt = _pyplot()
    heights = [max(len(line.bars), 1) * 0.32 + 0.8 for line in lines]
    fig, axes = plt.subplots(
        len(lines), 1, figsize=(11, sum(heights)), sharex=True, squeeze=False, gridspec_kw={"height_ratios": heights}
    )
    labels = [label for ax, line in zip(axes[:, 0], lines) for label in _draw(ax, line)]
    axes[-1, 0].set_xlabel("seconds since the first span")
    fig.tight_layout()
    return fig, labels


def _draw(ax: Any, line: Any) -> list[Any]:
    """The bars and their labels (returned): a label starts after its bar's end, or, past
    ``INSIDE_FROM`` of the panel's width (the process bar, the last stages), ends at it, so no
    label runs off the figure's right edge."""
    labels = []
    for row, bar in enumerate(line.bars):
        ax.barh(
            row,
            max(bar.duration_s, 1e-4),
            left=bar.start_s,
            color=PNG_COLORS.get(bar.outcome, "#1565c0"),
            height=0.6 if bar.level else 0.8,
        )
        text = f"{bar.duration_s * 1000:.0f} ms {bar.note[:60]}".strip()
        inside = bar.end_s > INSIDE_FROM * line.end_s
        labels.append(
            ax.text(
                bar.end_s,
                row,
                f"{text}  " if inside else f"  {text}",
                ha="right" if inside else "left",
                va="center",
                fontsize=7,
                parse_math=False,
            )
        )
    ax.set_yticks(
        range(len(line.bars)),
        [("· " if b.level == 2 else "") + b.label for b in line.bars],
        fontsize=8,
        parse_math=False,
    )
    ax.invert_yaxis()
    ax.set_title(f"{line.source}: {line.end_s:.3f} s", fontsize=9, loc="left", parse_math=False)
    ax.grid(axis="x", alpha=0.3)
    return labels
