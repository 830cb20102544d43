"""Golden results: the simulator's rows and per-request metrics on a handful of small,
varied configs, compared to values recorded from the code before its speed work
(tests/data/sim_golden.json), to 1e-9 relative. A speed-up must not change a result.

Regenerate only for an intended change of results:
    python tests/test_sim_golden.py   (writes tests/data/sim_golden.json)
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from pathlib import Path

import pytest

from kvsim.core.compose import compose
from kvsim.scenario.config import SimConfig
from kvsim.scenario.metrics import request_row
from kvsim.scenario.variants import variants
from kvsim.sim.run import Scenario

GOLDEN_PATH = Path(__file__).parent / "data" / "sim_golden.json"
# The codec timings the values were recorded with (data/codec_timing/h100.json as it was, all
# assumed): the goldens check the engine, so a new measurement of the shipped file does not
# move them
TIMING = "codec_timing=" + str(Path(__file__).parent / "data" / "codec_timing_h100_assumed.json")
REL_TOL = 1e-9
# wall-clock and event-count fields measure the simulator's speed, not its results
SPEED_KEYS = {"wall_s", "events", "events_per_s"}
CONFIG_ECHO = {"codec_params", "handshake_s"}  # what the row repeats of its config

# transfer=seeds: the policies the values were recorded under (monolithic / split_stream)
SINGLE = [TIMING, "scenario=none", "transfer=seeds", "link=25g", "workload=single",
          "workload.context_tokens=5000", "codecs=[bf16,int8,lynx]"]
# 30 Poisson requests at overload on 3 prefill + 2 decode instances: queues, shared links,
# several members in each decode batch
POISSON = [TIMING, "scenario=none", "transfer=seeds", "link=25g", "workload=poisson",
           "workload.requests=30", "workload.rate_per_s=20", "workload.context_tokens=6000",
           "workload.context_max_tokens=20000", "workload.output_tokens=32",
           "workload.prefill_nodes=3", "workload.decode_nodes=2", "workload.decode_max_batch=8",
           "codecs=[int8,lynx]", "metrics.ks=[1,8,32]"]
CASES: dict[str, list[str]] = {
    "single-page": SINGLE + ["granularity=page"],
    "single-layer": SINGLE + ["granularity=layer"],
    "single-trace": [TIMING, "scenario=none", "transfer=seeds", "link=wan-trace",
                     "workload=single", "workload.context_tokens=30000", "codecs=[lynx,int8]"],
    "poisson-anchors-first": POISSON + ["link.scheduling=anchors_first"],
    "poisson-fifo-shared": POISSON + ["link.scheduling=fifo", "link.sharing=shared",
                                      "granularity=layer"],
    "poisson-weighted": POISSON + ["link.scheduling=weighted", "link.bandwidth_gbps=8"],
    "poisson-aging-shared": POISSON + ["link.scheduling=aging", "link.sharing=shared",
                                       "link.bandwidth_gbps=10"],
    "poisson-trace": POISSON + ["link=wan-trace", "granularity=layer"],
    "poisson-ingress": POISSON + ["link.decode_ingress_gbps=12", "link.bandwidth_gbps=10"],
    "poisson-node-deserializer": POISSON + ["deserializer=node", "link.message_overhead_bytes=64"],
    "poisson-per-stream-chunked": POISSON + ["deserializer=per_stream",
                                             "workload.prefill_chunk_tokens=4096"],
    "poisson-samples": POISSON + ["samples=2", "link.bandwidth_gbps=40"],
}


def _flatten(value, prefix: str, out: dict[str, float]) -> None:
    """Numeric leaves of a row (nested dicts and lists) as {path: float}."""
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}[{i}]", out)
    elif isinstance(value, bool):
        out[prefix] = float(value)
    elif isinstance(value, (int, float)):
        out[prefix] = float(value)
    elif hasattr(value, "item"):  # numpy scalar
        out[prefix] = float(value.item())


def results(overrides: list[str]) -> dict[str, float]:
    """Every numeric field of every row of the config, and every request's metrics and
    token times (drafted and committed), flattened."""
    cfg, _ = compose("sim", list(overrides), SimConfig)
    cfg.validate()
    out: dict[str, float] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for v in variants(cfg):
            key = f"{v.spec.label}/{v.policy}"
            scenario = Scenario(cfg, v, cfg.workload.context_tokens, cfg.link.bandwidth_gbps)
            row = scenario.run_samples(cfg.samples)
            _flatten({k: x for k, x in row.items() if k not in SPEED_KEYS | CONFIG_ECHO}, key,
                     out)
            ks = list(cfg.metrics.ks)
            for rec in sorted(scenario.records, key=lambda r: r.seq):  # the last sample's
                rkey = f"{key}/r{rec.seq}"
                _flatten(request_row(rec, ks, cfg.metrics.breakdown_k), rkey, out)
                # tokens 4, 8, ... (drafted and committed)
                _flatten(rec.timeline.token_t[3::4].tolist(), f"{rkey}.token_t", out)
                _flatten(rec.timeline.committed_t[3::4].tolist(), f"{rkey}.committed_t", out)
                _flatten([rec.arrival_t, rec.encode_end_t, rec.needed_arrival_t,
                          rec.needed_backlog_t, rec.all_arrival_t, rec.full_ready_t,
                          rec.decode_start_t, rec.received_bytes], f"{rkey}.times", out)
    return out


def _close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b)) or abs(a - b) <= 1e-300


@pytest.mark.parametrize("case", sorted(CASES))
def test_results_match_the_recorded_golden_values(case):
    golden = json.loads(GOLDEN_PATH.read_text())[case]
    got = results(CASES[case])
    keys = sorted(got)
    assert _keys_digest(keys) == golden["keys_sha256"], "the set of result fields changed"
    bad = [(k, g, got[k]) for k, g in zip(keys, golden["values"], strict=True)
           if not _close(float(g), got[k])]
    assert not bad, f"{len(bad)} of {len(keys)} values differ, e.g. {bad[:5]}"


def _keys_digest(keys: list[str]) -> str:
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()


def _golden(overrides: list[str]) -> dict:
    """The stored form: the fields' names (sorted) as a digest, their values in that order."""
    got = results(overrides)
    keys = sorted(got)
    return {"keys_sha256": _keys_digest(keys), "values": [got[k] for k in keys]}


if __name__ == "__main__":
    data = {name: _golden(ov) for name, ov in CASES.items()}
    GOLDEN_PATH.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN_PATH.write_text(json.dumps(data, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"wrote {GOLDEN_PATH}: {sum(len(v['values']) for v in data.values())} values")
