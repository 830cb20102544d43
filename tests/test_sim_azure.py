"""`workload.kind=azure`: the generator (kvsim.scenario.azure_workload) against the shipped shape
files (marginal quantiles, rank correlation, arrival CV), seeds, clipping, bad config."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from scipy.stats import spearmanr

from kvsim.scenario.azure_workload import (
    AZURE_TRACES,
    arrival_gaps_s,
    azure_draws,
    load_azure_shape,
    load_azure_shape_file,
)
from kvsim.scenario.config import WorkloadConfig
from kvsim.scenario.workload import requests


@pytest.mark.parametrize("trace", AZURE_TRACES)
def test_shipped_shape_files_state_their_source(trace):
    shape = load_azure_shape(trace)
    raw = json.loads(open(shape.source).read())
    src = raw["source"]
    assert src["repo"] == "Azure/AzurePublicDataset"
    assert src["path"] == f"data/AzureLLMInferenceTrace_{trace}.csv"
    assert len(src["commit"]) == 40 and src["rows"] > 1000
    assert src["license"].startswith("CC-BY") and "Splitwise" in src["attribution"]


@pytest.mark.parametrize("trace", AZURE_TRACES)
def test_generator_reproduces_the_shipped_shape(trace):
    """20,000 draws: median and p90 of contexts and outputs within 3 % of the shipped tables,
    Spearman correlation within 0.03; 200,000 gaps at 4 requests/s: mean 0.25 s, and the CV of
    each arrival process (trace: the gap table's, itself within 10 % of the measured CV; gamma:
    the measured CV; poisson: 1)."""
    shape = load_azure_shape(trace)
    rng = np.random.default_rng(11)
    ctx, gen = azure_draws(shape, 20_000, rng)
    for draws, table in ((ctx, shape.context_tokens), (gen, shape.generated_tokens)):
        for q in (0.5, 0.9):
            want = float(np.interp(q, table.p, table.value))
            assert np.quantile(draws, q) == pytest.approx(want, rel=0.03), (trace, q)
    assert spearmanr(ctx, gen).statistic == pytest.approx(shape.spearman, abs=0.03)
    _, table_cv = shape.interarrival_s.moments()
    assert table_cv == pytest.approx(shape.interarrival_cv, rel=0.1)
    for process, cv in (("trace", table_cv), ("gamma", shape.interarrival_cv),
                        ("poisson", 1.0)):
        gaps = arrival_gaps_s(200_000, 4.0, shape, process, rng)
        assert gaps.mean() == pytest.approx(0.25, rel=0.1), process
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1), process
    if trace == "code":
        assert table_cv > 3  # the code trace is bursty: far from Poisson
    else:
        assert 0.9 < table_cv < 1.5  # conversation arrivals are close to Poisson


def _azure(**kw) -> WorkloadConfig:
    base = WorkloadConfig(kind="azure", requests=500, rate_per_s=3.0, context_min_tokens=16,
                          context_max_tokens=8192, context_round_tokens=16)
    return replace(base, **kw)


def test_azure_requests_are_seeded_clipped_rounded_and_decode_their_own_outputs():
    a = requests(_azure(), np.random.default_rng(5))
    b = requests(_azure(), np.random.default_rng(5))
    c = requests(_azure(), np.random.default_rng(6))
    assert a == b and a != c
    assert a[0].arrival_t == 0.0 and len(a) == 500
    t = np.array([r.arrival_t for r in a])
    assert np.all(np.diff(t) >= 0)
    assert len({r.output_tokens for r in a}) > 10  # per-request outputs, not output_tokens
    tight = requests(_azure(context_max_tokens=1000, context_min_tokens=300,
                            context_round_tokens=256), np.random.default_rng(5))
    ctx = np.array([r.context_tokens for r in tight])
    assert set(ctx) <= {512, 768, 1024}  # clipped to [300, 1000], rounded up to 256
    assert _azure().max_output_tokens() == load_azure_shape("code").max_generated_tokens()


@pytest.mark.parametrize("key, value", [("azure_trace", "chat"),
                                        ("azure_arrivals", "bursty")])
def test_bad_azure_config_names_the_key(key, value):
    with pytest.raises(ValueError, match=f"workload.{key} must be one of"):
        requests(_azure(**{key: value}), np.random.default_rng(0))


def test_bad_shape_file_is_refused(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"rank_correlation": {"spearman": 0.1},
                                "arrivals": {"mean_rate_per_s": 1.0,
                                             "interarrival_s": {"cv": 2.0}},
                                "context_tokens": {"p": [0.0, 0.5], "value": [1, 2]},
                                "generated_tokens": {"p": [0.0, 1.0], "value": [1, 2]}}))
    with pytest.raises(ValueError, match="context_tokens quantiles must run from p=0 to p=1"):
        load_azure_shape_file(path)


@pytest.mark.parametrize("trace", AZURE_TRACES)
def test_azure_preset_runs_in_the_simulator_with_per_request_outputs(trace, tmp_path):
    """The azure-<trace> preset composes and drives a small run: every request arrives, decodes
    its own drawn output length, and the report records the shape file it loaded."""
    from kvsim.core.compose import compose
    from kvsim.core.data_files import loaded_files
    from kvsim.scenario.config import SimConfig
    from kvsim.sim.run import run_all

    cfg, _ = compose("sim", ["scenario=multi-poisson", f"workload=azure-{trace}",
                             "workload.requests=40", "codecs=[int8]",
                             f"requests_path={tmp_path / 'r.csv'}"], SimConfig)
    (row,), _ = run_all(cfg)
    assert row["requests"] == 40
    log = pd.read_csv(tmp_path / "r.csv")
    drawn = requests(cfg.workload, np.random.default_rng(cfg.seed))
    assert sorted(log["output_tokens"]) == sorted(r.output_tokens for r in drawn)
    assert log["output_tokens"].nunique() > 5
    assert any(f["path"] == f"data/workload/azure-2023-{trace}.json"
               for f in loaded_files())


@pytest.mark.parametrize("workload", ["azure-code", "bench-10k"])
def test_column_aggregate_equals_the_per_request_rows(workload):
    """aggregate_records (the simulator's multi-request row, per column) gives exactly
    aggregate_request_rows over request_row dicts (the emulator's path): every key, in
    order, with requests of different output lengths (azure) and of one (bench)."""
    import json

    from kvsim.core.compose import compose
    from kvsim.scenario.config import SimConfig
    from kvsim.scenario.metrics import aggregate_records, aggregate_request_rows, request_row
    from kvsim.scenario.variants import variants
    from kvsim.sim.run import Scenario

    cfg, _ = compose("sim", ["scenario=none", "model=llama-3.1-8b", "hardware=h100",
                             "link=25g", f"workload={workload}", "workload.requests=60",
                             "codecs=[lynx]", "granularity=layer"], SimConfig)
    scenario = Scenario(cfg, variants(cfg)[0], cfg.workload.context_tokens,
                        cfg.link.bandwidth_gbps)
    scenario.run()
    recs, ks, bk = scenario.records, list(cfg.metrics.ks), cfg.metrics.breakdown_k
    if workload.startswith("azure"):
        assert len({len(r.timeline.token_t) for r in recs}) > 5
    by_column = aggregate_records(recs, ks, bk)
    by_row = aggregate_request_rows([request_row(r, ks, bk) for r in recs])
    assert json.dumps(by_column) == json.dumps(by_row)


def test_breakdown_columns_equal_each_records_breakdown():
    """breakdown_columns (every record at once) gives exactly RequestRecord.breakdown per
    record, on a loaded split-stream run where many requests wait for their residual
    ("wait" segments split between transfer and deserialization) and some drafts are
    rejected."""
    import numpy as np

    from kvsim.core.compose import compose
    from kvsim.scenario.config import SimConfig
    from kvsim.scenario.metrics import BREAKDOWN_KEYS, breakdown_columns
    from kvsim.scenario.variants import variants
    from kvsim.sim.run import Scenario

    cfg, _ = compose("sim", ["scenario=multi-poisson", "link.bandwidth_gbps=10",
                             "codecs=[lynx]"], SimConfig)
    scenario = Scenario(cfg, variants(cfg)[0], cfg.workload.context_tokens,
                        cfg.link.bandwidth_gbps)
    scenario.run()
    recs = scenario.records
    kinds = [seg[0] for r in recs for seg in r.timeline.segments]
    assert kinds.count("wait") > 20 and "draft_rejected" in kinds and "decode" in kinds
    for k in (1, 7, cfg.metrics.breakdown_k):
        end_t = np.array([r.ttkt(min(k, len(r.timeline.token_t))) for r in recs])
        columns = breakdown_columns(recs, end_t)
        for i, rec in enumerate(recs):
            one = rec.breakdown(min(k, len(rec.timeline.token_t)))
            # bit patterns: == would not tell -0.0 from 0.0
            assert np.array([columns[key][i] for key in BREAKDOWN_KEYS]).view(np.int64).tolist() \
                == np.array([one[key] for key in BREAKDOWN_KEYS]).view(np.int64).tolist(), (k, i)
