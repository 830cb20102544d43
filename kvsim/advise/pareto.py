"""Pareto front of (time, quality error) points: both are minimised.

A point is on the front when no other point is at least as good in both coordinates and
strictly better in one. Equal points are all kept (neither dominates the other).
"""

from __future__ import annotations

from collections.abc import Sequence


def dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """a is no worse than b in both coordinates and better in at least one."""
    return a[0] <= b[0] and a[1] <= b[1] and (a[0] < b[0] or a[1] < b[1])


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated points, ordered by the first coordinate (time), then
    the second. O(n log n): sweep in time order keeping the best error so far."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front: list[int] = []
    best_err = float("inf")
    best_time_at_err = float("inf")  # the time of the point that set best_err
    for i in order:
        t, err = points[i]
        if err < best_err:
            front.append(i)
            best_err, best_time_at_err = err, t
        elif err == best_err and t == best_time_at_err:  # a duplicate of a front point
            front.append(i)
    return front
