"""What every figure kvsim draws must hold, checked on the matplotlib Figure a kind's make()
returns: each axis of a panel with data that shows a quantity (not named categories) is
labelled with its unit in parentheses ("(s, from request arrival)", "(bits per KV
element)", "(probability)"); every legend entry names a series drawn with at least one point
inside the panel; no line lies hidden under another (a line on another line must be dashed
or hollow-marked so both show)."""

from __future__ import annotations

import math
import re

import numpy as np
from matplotlib.category import StrCategoryConverter
from matplotlib.collections import PathCollection
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

UNIT = re.compile(r"\([^)]*\S[^)]*\)")  # "(s)", "(Gbps, log scale)", "(probability)"


def drawn_labels(fig: Figure) -> set[str]:
    """Labels of every artist with a point inside its panel's limits."""
    out: set[str] = set()
    for ax in fig.axes:
        for line in ax.get_lines():
            if line.get_visible() and _inside(ax, line.get_xdata(), line.get_ydata()):
                out.add(line.get_label())
        for coll in ax.collections:
            offsets = np.asarray(coll.get_offsets())
            if coll.get_visible() and len(offsets) and _inside(ax, offsets[:, 0],
                                                               offsets[:, 1]):
                out.add(coll.get_label())
            elif coll.get_visible() and not isinstance(coll, PathCollection):
                out.add(coll.get_label())  # a band (fill_between): drawn where its line is
        for container in ax.containers:  # bars: a segment of positive size
            if any(abs(p.get_width()) > 0 and abs(p.get_height()) > 0 for p in container):
                out.add(container.get_label())
        for patch in ax.patches:
            if abs(patch.get_width()) > 0 and abs(patch.get_height()) > 0:
                out.add(patch.get_label())
    return {label for label in out if label and not label.startswith("_")}


def _inside(ax, xs, ys) -> bool:
    """Whether any finite point lies within the panel's limits."""
    (x0, x1), (y0, y1) = sorted(ax.get_xlim()), sorted(ax.get_ylim())
    return any(x0 <= float(x) <= x1 and y0 <= float(y) <= y1
               for x, y in zip(xs, ys, strict=False)
               if math.isfinite(float(x)) and math.isfinite(float(y)))


def legend_entries(fig: Figure) -> list[str]:
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    legends += list(fig.legends)
    return [t.get_text() for lg in legends for t in lg.get_texts()]


def check_units(fig: Figure) -> None:
    for ax in fig.axes:
        if not ax.has_data():
            continue
        for axis, label in ((ax.xaxis, ax.get_xlabel()), (ax.yaxis, ax.get_ylabel())):
            if isinstance(axis.get_converter(), StrCategoryConverter):
                continue  # named categories (one bar per codec): no quantity, no unit
            if label == "" and not axis.get_visible():
                continue
            assert UNIT.search(label), f"axis label without a unit: {label!r}"


def check_legend(fig: Figure) -> None:
    drawn = drawn_labels(fig)
    for entry in legend_entries(fig):
        assert entry in drawn, f"legend entry {entry!r} names nothing drawn ({sorted(drawn)})"


def _hollow(line: Line2D) -> bool:
    face = line.get_markerfacecolor()
    return face == "none" or to_rgba(face)[3] == 0


def check_nothing_hidden(fig: Figure, fraction: float = 0.01) -> None:
    """Two lines of one panel whose points all lie within `fraction` of the panel's range of
    each other: the later must be dashed or hollow-marked. (Scatter points sharing a place
    are checked by the codecs and pareto figures' own tests: rings around one point.)"""
    for ax in fig.axes:
        (y0, y1) = sorted(ax.get_ylim())
        tol = fraction * (y1 - y0) if ax.get_yscale() == "linear" else 0.0
        lines = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")
                 and len(ln.get_xdata()) > 1]
        for i, later in enumerate(lines):
            for earlier in lines[:i]:
                xa = np.asarray(earlier.get_xdata(), float)
                ya = np.asarray(earlier.get_ydata(), float)
                xb = np.asarray(later.get_xdata(), float)
                yb = np.asarray(later.get_ydata(), float)
                if xa.shape != xb.shape or not np.allclose(xa, xb):
                    continue
                close = np.all(np.abs(ya - yb) <= np.maximum(tol, 0.005 * np.abs(ya)))
                if close:
                    assert later.get_linestyle() not in ("-", "solid") or _hollow(later), (
                        f"{later.get_label()!r} lies on {earlier.get_label()!r} and is drawn "
                        "the same way: one hides the other")


def check_figure(fig: Figure) -> None:
    check_units(fig)
    check_legend(fig)
    check_nothing_hidden(fig)
