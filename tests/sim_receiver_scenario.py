"""One request of the real SmolLM2 on the emulated link, as `kvsim validate` simulates it:
the scenario the receiver-model tests (deserializer=on_demand / on_arrival) build on."""

from __future__ import annotations

from kvsim.core.compose import compose
from kvsim.scenario.config import SimConfig
from kvsim.scenario.variants import variants
from kvsim.sim.run import Scenario

# transfer=seeds: monolithic / split_stream, the policies the expectations below are of
BASE = ["scenario=none", "transfer=seeds", "model=smollm2-135m", "hardware=local-cpu",
        "link=emulated",
        "workload=emulated", "workload.context_tokens=1024", "workload.output_tokens=32",
        "speculative.draft_overhead_s=0", "speculative.acceptance=smollm2-135m-lynx-s1-greedy"]


def receiver_scenario(*overrides: str) -> Scenario:
    """The first codec x transfer variant of BASE + overrides, ready to run()."""
    cfg, _ = compose("sim", [*BASE, *overrides], SimConfig)
    return Scenario(cfg, variants(cfg)[0], cfg.workload.context_tokens,
                    cfg.link.bandwidth_gbps)
