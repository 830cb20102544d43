"""The host's decode step, run after run: how much it moves between back-to-back requests
with nothing else of kvsim running (kvsim.fidelity.step_stability). The noise floor under
`kvsim validate`'s per-request comparisons on this host."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field

from omegaconf import MISSING

from kvsim.core.report import format_table
from kvsim.model.spec import ModelSpec

COMMAND = ("bench", "step")
HELP = "the decode step's spread from run to run on this host (a validation's noise floor)"
CONFIG_NAME = "bench_step"


@dataclass
class Config:
    model: ModelSpec = MISSING
    contexts: list[int] = field(default_factory=lambda: [1024])  # prompt tokens
    runs: int = 12  # runs per context, each on a fresh cache (as one request each)
    steps: int = 32  # decode steps timed per run (after the first)
    threads: int = 1  # the decoder's torch threads (transport.threads)
    text_source: str = "stdlib-docs"
    seed: int = 1009  # the prompts' text seed (calibration's)
    timeout_s: float = 600.0  # per run
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.contexts or any(int(c) < 16 for c in self.contexts):
            raise ValueError(f"contexts must be a non-empty list of >= 16 tokens, got "
                             f"{self.contexts}")
        if self.runs < 2 or self.steps < 1 or self.threads < 1:
            raise ValueError(f"need runs >= 2, steps >= 1, threads >= 1; got {self.runs}, "
                             f"{self.steps}, {self.threads}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


def run(cfg: Config) -> dict:
    import torch

    from kvsim.calibrate.model_profile import ModelCalibration, _prompt
    from kvsim.fidelity.step_stability import measure, stability
    from kvsim.kv.capture import cache_to_kv, prefill
    from kvsim.model.load import load_lm

    say = (lambda msg: print(f"bench step: {msg}", file=sys.stderr, flush=True)) \
        if cfg.progress else (lambda msg: None)
    lm = load_lm(cfg.model, threads=cfg.threads, seed=0)  # sets torch's threads
    rows, summary = [], []
    for ctx in cfg.contexts:
        ids = _prompt(lm, int(ctx), ModelCalibration([int(ctx)], text_source=cfg.text_source,
                                                     seed=cfg.seed))
        with torch.no_grad():
            cache, logits = prefill(lm.model, ids)
        kv = cache_to_kv(cache).to(torch.bfloat16)
        runs = measure(lm, kv, int(torch.argmax(logits)), cfg.runs, cfg.steps, cfg.threads,
                       cfg.timeout_s, say)
        spread = stability(runs)
        rows += [{**asdict(r), "ratio": r.mean_step_s / spread.median_step_s, "model": lm.name}
                 for r in runs]
        summary.append(asdict(spread))
    print(format_table(rows, [("context_tokens", "ctx", "d"), ("run", "run", "d"),
                              ("mean_step_s", "mean step s", ".4f"),
                              ("ratio", "/ median run", ".3f"),
                              ("background_cores", "other CPUs", ".2f")]))
    for s in summary:
        print(f"context {s['context_tokens']}: {s['runs']} runs of {cfg.steps} steps, median "
              f"{s['median_step_s'] * 1e3:.1f} ms; back-to-back runs "
              f"{s['consecutive_mean'] * 100:.1f}% apart on average "
              f"({s['consecutive_max'] * 100:.1f}% at most), cv {s['cv'] * 100:.1f}%, "
              f"slowest / fastest {s['slowest_over_fastest']:.3f}; two back-to-back runs' "
              f"mean {s['pair_mean'] * 100:.1f}% from the median run on average "
              f"({s['pair_max'] * 100:.1f}% at most)")
    return {"rows": rows, "stability": summary}
