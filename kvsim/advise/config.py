"""Typed configuration of `kvsim advise`: the `kvsim sim` keys (model=, hardware=, link=,
workload=, scenario=, ...) plus the quality floor and what to rank by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvsim.scenario.config import SimConfig
from kvsim.scenario.objective import objective_key

DEFAULT_FLOOR = 1e-3  # attention-output vNMSE bound
DEFAULT_OBJECTIVE = "ttkt_committed_s.32"
DEFAULT_TIE_S = 0.01  # s: below what a user notices


@dataclass
class AdviseConfig(SimConfig):
    # lossless | none | a vNMSE bound (attention-output vNMSE with every stream used)
    floor: Any = DEFAULT_FLOOR
    # the time ranked: ttft_s | ttft_committed_s | ttkt_s.K | ttkt_committed_s.K (seconds
    # from request arrival; -committed: a drafted token counts once verified)
    objective: str = DEFAULT_OBJECTIVE
    # candidates within this many seconds of the fastest admissible one count as tied, and
    # the tie goes to the lowest vNMSE, then the fewest bytes (10 ms is below what a user
    # notices; 0: strictly the fastest)
    tie_s: float = DEFAULT_TIE_S
    top: int = 12  # ranked rows printed (every row is in report.json)
    # measured acceptance per codec: a data/acceptance/ file name in which CODEC stands for
    # the codec label, e.g. smollm2-135m-CODEC-s1-greedy; a several-stream codec whose file
    # exists drafts with its own curve (a 2-bit anchor is accepted less than a 4-bit one);
    # "": every codec drafts with speculative.acceptance, as in `kvsim sim`
    acceptance_files: str = ""

    def validate(self) -> None:
        if not self.codecs:  # empty: every preset in conf/codec
            from kvsim.kernels.presets import preset_names

            self.codecs = preset_names()
        super().validate()
        for key in ("trace_path", "requests_path"):
            if getattr(self, key):  # one file per `kvsim sim` run; advise runs dozens
                raise ValueError(f"{key} is a `kvsim sim` output: advise simulates every "
                                 "candidate and writes no event log or request rows; run "
                                 f"`kvsim sim` with the recommended codec and {key}=...")
        objective_key(self.objective)
        from kvsim.advise.floor import parse_floor

        parse_floor(self.floor)
        if not isinstance(self.tie_s, (int, float)) or not self.tie_s >= 0:
            raise ValueError(f"tie_s must be a number >= 0 (seconds), got {self.tie_s!r}")
        if isinstance(self.top, bool) or not isinstance(self.top, int) or self.top < 1:
            raise ValueError(f"top must be an integer >= 1, got {self.top!r}")
        if self.acceptance_files and "CODEC" not in self.acceptance_files:
            raise ValueError(f"acceptance_files must contain CODEC (where the codec label "
                             f"goes), got {self.acceptance_files!r}")
