"""PNG line plots for run comparisons (matplotlib's Agg canvas: no display, no global pyplot state)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def line_plot(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    path: str | Path,
) -> Path:
    """One line per `label: (x, y)` in one PNG at `path`; returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for label, (x, y) in series.items():
        x, y = list(x), list(y)
        axes.plot(x, y, label=label, linewidth=1.5, marker="o" if len(x) <= 50 else None, markersize=3)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    if series:
        axes.legend()
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, format="png")
    return path
