"""``bootstrap trace --png``: every bar's label lies inside its panel, the process bar's coverage
note and the last stages' included (they ran to the figure's right edge and past it, and the
layout squeezed the panels to make room), read from matplotlib's layout of the figure
``write_png`` saves."""

from __future__ import annotations

import pytest

from bootstrap.cli.trace.png import figure
from bootstrap.cli.trace.timeline import Bar, Timeline

pytest.importorskip("matplotlib")


def test_every_label_is_inside_its_panel():
    note = "spans cover 97% to ready, 100% after; the longest note a bar gets is cut at 60"
    bars = [
        Bar("process", 0, 0.0, 9.0, "ok", note),
        Bar("pipeline run 1", 0, 0.5, 8.0, "ok"),
        Bar("profiling", 1, 1.0, 2.0, "ok", "a short one, on the left"),
        Bar("scheduler_sampler", 1, 8.0, 8.9, "failed", "RuntimeError: the last stage, at the right edge"),
        Bar("shutdown", 0, 8.95, 9.0, "ok", note),
    ]
    fig, labels = figure([Timeline("trace.jsonl", bars), Timeline("second.jsonl", bars[:3])])
    try:
        renderer = fig.canvas.get_renderer()
        assert len(labels) == 8
        for label in labels:
            box, panel = label.get_window_extent(renderer), label.axes.get_window_extent(renderer)
            assert panel.x0 <= box.x0 and box.x1 <= panel.x1, label.get_text()
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
