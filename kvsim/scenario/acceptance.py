"""Speculative-acceptance models: how many drafted tokens survive verification.

An acceptance model gives the survival curve S(k) = P(accepted >= k) for k = 0..max_k
(S(0) = 1, non-increasing), for drafting on a stream prefix of a codec and verifying on
the full cache. Three kinds:

- geometric: each drafted token is accepted with probability `a` given all earlier ones
  were: S(k) = a**k.
- seeds-fig10: the Lynx paper's Figure 10(a) (Qwen3-32B, MMLU-Pro). The text states only
  P(>=10) = 0.88 and P(>=20) = 0.70 (and 19.38 accepted of 21.43 proposed on average);
  the curve is piecewise geometric through (0, 1), (10, 0.88), (20, 0.70) and extrapolated
  past 20 at the 10->20 per-token rate. Everything but the two stated points is assumed,
  and the model's metadata says so.
- a measured file written by `kvsim quality`: data/acceptance/<name>.json.

File format (version 1), JSON:
  {"version": 1, "name": str, "model": str, "codec": str, "streams_used": int,
   "context_tokens": int, "text": str, "decoding": "greedy"|"sampling", "runs": int,
   "max_draft": int, "survival": [S(0)=1.0, S(1), ..., S(max_draft)],
   "source": "measured" | "paper" | "analytic", ...extra provenance}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvsim.core.data_files import record_loaded
from kvsim.core.paths import DATA_DIR

ACCEPTANCE_DIR = DATA_DIR / "acceptance"
FORMAT_VERSION = 1

# Points of Figure 10(a) of the Lynx paper that its text states: k -> P(accepted >= k).
_FIG10_STATED = {0: 1.0, 10: 0.88, 20: 0.70}


@dataclass
class AcceptanceModel:
    name: str
    survival: list[float]  # survival[k] = P(accepted >= k), k = 0..max_draft
    source: str = "analytic"
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        s = np.asarray(self.survival, dtype=float)
        if s.ndim != 1 or len(s) < 1:
            raise ValueError(f"acceptance model {self.name!r}: survival must be a non-empty list")
        if not np.all(np.isfinite(s)) or s.min() < 0 or s.max() > 1 + 1e-9:
            raise ValueError(f"acceptance model {self.name!r}: survival values must be in [0, 1]")
        if abs(s[0] - 1.0) > 1e-9:
            raise ValueError(f"acceptance model {self.name!r}: survival[0] must be 1")
        if np.any(np.diff(s) > 1e-9):
            raise ValueError(f"acceptance model {self.name!r}: survival must be non-increasing")

    @property
    def max_k(self) -> int:
        return len(self.survival) - 1

    def survival_at(self, k: int) -> float:
        """P(accepted >= k); beyond the curve's end, geometric extrapolation of the tail."""
        if k <= self.max_k:
            return float(self.survival[k])
        s = self.survival
        last, prev = s[-1], s[-2] if len(s) > 1 else 1.0
        rate = last / prev if prev > 0 else 0.0
        return float(last * rate ** (k - self.max_k))

    def mean_accepted(self, proposed: int) -> float:
        """E[min(accepted, proposed)] = sum_{k=1..proposed} S(k)."""
        return float(sum(self.survival_at(k) for k in range(1, proposed + 1)))

    def sample_accepted(self, proposed: int, rng: np.random.Generator) -> int:
        """Draw how many of `proposed` drafted tokens are accepted (longest matching prefix)."""
        u = rng.random()
        accepted = 0
        while accepted < proposed and self.survival_at(accepted + 1) > u:
            accepted += 1
        return accepted

    def to_dict(self) -> dict:
        return {"version": FORMAT_VERSION, "name": self.name, "source": self.source,
                "survival": [float(x) for x in self.survival], **self.meta}

    def save(self, path: str | Path | None = None) -> Path:
        path = Path(path) if path else ACCEPTANCE_DIR / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path


def geometric(a: float, max_k: int = 64) -> AcceptanceModel:
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"geometric acceptance needs 0 <= a <= 1, got {a}")
    return AcceptanceModel(f"geometric-{a:g}", [a**k for k in range(max_k + 1)], "analytic",
                           {"a": a})


def seeds_fig10(max_k: int = 64) -> AcceptanceModel:
    """Piecewise-geometric survival through the stated points of the paper's Figure 10(a)."""
    ks = sorted(_FIG10_STATED)
    log_s = np.log([_FIG10_STATED[k] for k in ks])
    k = np.arange(max_k + 1)
    curve = np.exp(np.interp(k, ks, log_s))
    tail_rate = (log_s[-1] - log_s[-2]) / (ks[-1] - ks[-2])  # log per token, 10 -> 20
    beyond = k > ks[-1]
    curve[beyond] = np.exp(log_s[-1] + tail_rate * (k[beyond] - ks[-1]))
    return AcceptanceModel("seeds-fig10", curve.tolist(), "paper+assumed", {
        "model": "Qwen3-32B", "text": "MMLU-Pro (Lynx Figure 10a)",
        "stated_points": {str(k): v for k, v in _FIG10_STATED.items()},
        "assumed": "geometric between the stated points and beyond k=20",
    })


def load_acceptance(name_or_path: str) -> AcceptanceModel:
    """By name: 'geometric:0.9', 'seeds-fig10', a file name in data/acceptance/, or a path."""
    if name_or_path.startswith("geometric:"):
        return geometric(float(name_or_path.split(":", 1)[1]))
    if name_or_path == "seeds-fig10":
        return seeds_fig10()
    path = Path(name_or_path)
    if not path.is_file():
        path = ACCEPTANCE_DIR / f"{name_or_path}.json"
    if not path.is_file():
        known = sorted(p.stem for p in ACCEPTANCE_DIR.glob("*.json"))
        raise ValueError(f"unknown acceptance model {name_or_path!r}; use geometric:<a>, "
                         f"seeds-fig10, a path, or one of {known}")
    doc = json.loads(path.read_text())
    record_loaded(path)
    if doc.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: acceptance file version {doc.get('version')} "
                         f"!= {FORMAT_VERSION}")
    meta = {k: v for k, v in doc.items() if k not in ("version", "name", "source", "survival")}
    return AcceptanceModel(doc["name"], doc["survival"], doc.get("source", "measured"), meta)


__all__ = ["AcceptanceModel", "geometric", "seeds_fig10", "load_acceptance"]
