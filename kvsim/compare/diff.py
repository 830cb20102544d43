"""Match two runs' rows by (codec, transfer, context_tokens, bandwidth_gbps), difference
each metric (B - A), and flag a difference larger than the two 95% intervals combined
(|B - A| > half_A + half_B: the intervals do not overlap). A flag needs both runs' spread
(samples > 1); a run of one sample has none and is never flagged. The configurations are
diffed key by key."""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.compare.runs import RowKey, Run

# a configuration key that names where a file went, not what was simulated
_OUTPUT_KEYS = ("report", "trace_path", "requests_path")


@dataclass
class MetricDiff:
    key: RowKey
    metric: str
    a: float
    b: float
    half_a: float | None  # 95% half-width of A's mean (None: one sample)
    half_b: float | None

    @property
    def diff(self) -> float:
        return self.b - self.a

    @property
    def relative(self) -> float | None:
        return None if self.a == 0 else self.diff / abs(self.a)

    @property
    def beyond_intervals(self) -> bool | None:
        """True when the difference exceeds both half-widths together; None without spread
        on both sides."""
        if self.half_a is None or self.half_b is None:
            return None
        # float round-off of equal paths (1e-19 s) is no difference: 1e-9 relative slack
        slack = 1e-9 * max(abs(self.a), abs(self.b))
        return abs(self.diff) > self.half_a + self.half_b + slack


@dataclass
class ConfigDiff:
    key: str
    a: object
    b: object


@dataclass
class Comparison:
    metrics: list[MetricDiff]
    only_a: list[RowKey]
    only_b: list[RowKey]
    config: list[ConfigDiff]


def _by_key(run: Run) -> dict:
    out: dict = {}
    for row in run.rows:
        if row.key in out:
            raise ValueError(f"{run.path}: two rows for codec={row.key[0]} transfer={row.key[1]} "
                             f"context={row.key[2]} bandwidth={row.key[3]:g} (a sweep that also "
                             f"varies {', '.join(run.varying) or 'another key'}); compare "
                             "tables with one row per (codec, transfer, context, bandwidth)")
        out[row.key] = row
    return out


def diff_configs(a: dict, b: dict, skip: list[str] | tuple[str, ...] = ()) -> list[ConfigDiff]:
    """Keys whose values differ (a key missing on one side shows as None there)."""
    out = []
    for key in sorted(set(a) | set(b)):
        if key in _OUTPUT_KEYS or key in skip:
            continue
        if a.get(key) != b.get(key):
            out.append(ConfigDiff(key, a.get(key), b.get(key)))
    return out


def compare_runs(a: Run, b: Run, metrics: list[str] | None = None) -> Comparison:
    rows_a, rows_b = _by_key(a), _by_key(b)
    # one label, another codec (its name or params): not the same row
    shared = [k for k in rows_a if k in rows_b and
              same_setting(rows_a[k].setting, rows_b[k].setting)]
    diffs = []
    for key in shared:
        ra, rb = rows_a[key], rows_b[key]
        names = [m for m in ra.metrics if m in rb.metrics]
        if metrics:
            names = [m for m in metrics if m in ra.metrics and m in rb.metrics]
        for m in names:
            diffs.append(MetricDiff(key, m, ra.metrics[m], rb.metrics[m],
                                    ra.half_widths.get(m), rb.half_widths.get(m)))
    # a sweep's varying keys are the grid: they are compared row by row, not as config
    skip = sorted(set(a.varying) | set(b.varying))
    return Comparison(diffs, [k for k in rows_a if k not in shared],
                      [k for k in rows_b if k not in shared],
                      diff_configs(a.config, b.config, skip))


def same_setting(a: dict, b: dict) -> bool:
    """Whether two rows' settings agree on every field both name (older rows name fewer)."""
    return all(a[k] == b[k] for k in a.keys() & b.keys())
