"""Prefix reuse: the block cache (hits, misses, pins, eviction order), routing, traces with
prefix block ids, and the simulator's prefix delta, hand-computed on a tiny model."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from kvsim.kernels.codec import make_codec
from kvsim.model.hardware import HardwareSpec
from kvsim.model.spec import ModelSpec
from kvsim.scenario.config import SimConfig
from kvsim.scenario.prefix_cache import PrefixCache
from kvsim.scenario.request_trace import load_request_trace, read_trace, replay, trace_file
from kvsim.scenario.timing_model import TimingModel
from kvsim.sim.routing import kv_aware
from kvsim.sim.run import run_all

BLOCK = 512
BLOCK_BYTES = 2048 * BLOCK  # the tiny model's bf16 KV: 2 x 2 heads x 64 x 4 layers x 2 B


# ---- the cache ---------------------------------------------------------------------------
def test_match_stops_at_the_first_missing_block_and_pins_hold_blocks():
    c = PrefixCache(1.0, 10.0)
    kept, freed = c.insert([1, 2, 3])
    assert kept == [1, 2, 3] and freed == 0.0 and c.held_bytes == 3.0
    assert c.match([1, 2, 3, 4], 4) == 3
    assert c.match([1, 9, 3], 3) == 1  # 3 is held, but the prefix breaks at 9
    assert c.match([1, 2, 3], 2) == 2  # at most `limit`
    assert c.match([7, 1], 2) == 0
    c.pin([1, 2])
    assert c.evict(10.0) == 1.0  # only 3 was idle
    assert 3 not in c and 1 in c and 2 in c and c.evicted_blocks == 1
    c.unpin([1, 2])
    assert c.idle_bytes == 2.0


def test_eviction_is_least_recently_used_and_a_prompts_tail_first():
    c = PrefixCache(1.0, 3.0)
    c.insert([1, 2, 3])  # one prompt: 3 (its tail) is the first to go
    c.insert([4])  # room for 4: evicts 3
    assert sorted(c._pins) == [1, 2, 4] and c.evicted_blocks == 1
    c.pin([1, 2])  # the first prompt used again: 4 is now the least recently used
    c.unpin([1, 2])
    c.insert([5])
    assert sorted(c._pins) == [1, 2, 5]
    # a pinned cache keeps what it holds: a block that finds no room is not kept, nor
    # those after it
    c.pin([1, 2, 5])
    kept, freed = c.insert([6, 7])
    assert kept == [] and freed == 0.0 and sorted(c._pins) == [1, 2, 5]
    # adopt: a held block is pinned for the adopter, a new one kept pinned while room lasts
    c.unpin([5])
    adopted, shared, freed = c.adopt([2, 8, 9])
    assert adopted == [2, 8] and shared == 1 and freed == 1.0  # 5 made room for 8; 9: none
    assert c._pins == {1: 1, 2: 2, 8: 1}
    with pytest.raises(ValueError, match="block_bytes"):
        PrefixCache(0.0, 1.0)


def test_kv_aware_routing_takes_the_longest_prefix_within_the_load_bound():
    assert kv_aware([3, 1, 2], [5, 0, 2], load_slack=4) == 0
    assert kv_aware([3, 1, 2], [5, 0, 2], load_slack=1) == 2  # 0 is 2 above the least
    assert kv_aware([3, 1, 2], [0, 0, 0], load_slack=4) == 1  # no match: least loaded
    assert kv_aware([2, 1, 1], [4, 4, 4], load_slack=4) == 1  # equal matches: least loaded


# ---- traces ------------------------------------------------------------------------------
def _mooncake(path, rows, gz=False):
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


ROWS = [{"timestamp": 1000, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 1200, "output_length": 7, "hash_ids": [0, 2, 3]},
        {"timestamp": 4000, "input_length": 600, "output_length": 9, "hash_ids": [0, 4]}]


def test_mooncake_jsonl_is_read_windowed_and_scaled(tmp_path):
    for gz in (False, True):
        path = _mooncake(tmp_path / ("t.jsonl.gz" if gz else "t.jsonl"), ROWS, gz)
        tr = read_trace(path)
        assert tr.arrival_s.tolist() == [0.0, 0.5, 3.0]  # ms, from the first request
        assert tr.context_tokens.tolist() == [1000, 1200, 600]
        assert tr.output_tokens.tolist() == [5, 7, 9]
        assert tr.prefix_blocks == ((0, 1), (0, 2, 3), (0, 4))
    window = replay(tr, start_s=0.4, duration_s=3.0)  # [0.4, 3.4): the last two
    assert window.arrival_s.tolist() == [0.0, 2.5]
    assert window.prefix_blocks == ((0, 2, 3), (0, 4))
    assert replay(tr, max_requests=2, time_scale=2.0).arrival_s.tolist() == [0.0, 1.0]
    assert load_request_trace(path, 1).prefix_blocks == ((0, 1),)
    with pytest.raises(ValueError, match="no request arrives"):
        replay(tr, start_s=10.0)


@pytest.mark.parametrize("line, match", [
    ("{not json", "not JSON"),
    ('{"timestamp": 0, "input_length": 5}', "needs the keys"),
    ('{"timestamp": 2000, "input_length": 0, "output_length": 1, "hash_ids": [0]}',
     "input_length 0"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [0]}', "timestamp"),
    ('{"timestamp": 2000, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}',
     "hash_ids"),
])
def test_bad_mooncake_lines_are_refused_with_the_line(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=f"line 2.*{match}|line 2: {match}"):
        read_trace(path)
    path.write_text(json.dumps(ROWS[1]) + "\n" + json.dumps(ROWS[0]) + "\n")
    with pytest.raises(ValueError, match="line 2: timestamp goes back"):
        read_trace(path)


def test_the_shipped_traces_load_by_name_with_a_block_id_per_512_tokens():
    for name, n in (("mooncake-conversation", 12031), ("mooncake-synthetic", 3993)):
        tr = read_trace(name)
        assert len(tr.arrival_s) == n and tr.prefix_blocks is not None
        assert all(len(b) == -(-c // BLOCK) for b, c in
                   zip(tr.prefix_blocks, tr.context_tokens.tolist(), strict=True))
    assert trace_file("mooncake-synthetic").name == "mooncake-synthetic.jsonl.gz"
    with pytest.raises(ValueError, match="mooncake-conversation"):
        trace_file("mooncake-conversatoin")


# ---- the simulator -----------------------------------------------------------------------
def _cfg(tmp_path, arrivals, contexts, blocks, codecs=("bf16",), **prefix) -> SimConfig:
    model = ModelSpec(name="tiny", layers=4, attention_heads=4, kv_heads=2, head_dim=64,
                      hidden_size=256, params_total=1e8, params_active=1e8)
    hw = HardwareSpec(name="test", hbm_gb_per_s=100.0, bf16_tflops=10.0, memory_gb=100.0,
                      step_overhead_s=0.001)
    timing = tmp_path / "timing.json"
    timing.write_text(json.dumps({"version": 1, "hardware": "test", "default": {
        "encode_gb_per_s": 50.0, "decode_gb_per_s": 25.0, "source": "assumed",
        "assumption": "test"}}))
    cfg = SimConfig(model=model, hardware=hw, codecs=list(codecs), transfer="seeds",
                    codec_timing=str(timing), requests_path=str(tmp_path / "r.csv"),
                    min_samples=1)
    cfg.link = replace(cfg.link, bandwidth_gbps=1.0, latency_s=0.002)
    cfg.workload = replace(cfg.workload, kind="trace", output_tokens=130,
                           arrivals_t=list(arrivals), arrivals_context_tokens=list(contexts),
                           arrivals_prefix_blocks=[list(b) for b in blocks])
    cfg.prefix_cache = replace(cfg.prefix_cache, enabled=True, **prefix)
    return cfg


def _log(tmp_path) -> pd.DataFrame:
    return pd.read_csv(tmp_path / "r.csv").sort_values("request").reset_index(drop=True)


def _wire(tokens: int, model) -> int:
    return make_codec("bf16", {"page_tokens": 256}).size_table(model.kv_shape(tokens)).total_bytes


def test_a_held_prefix_sends_only_the_delta_and_prefills_only_the_rest(tmp_path):
    # r1 shares r0's 4 blocks (all 2048 of its tokens); r2 is r0 again: its hit stops at 3
    # blocks, since at least one token is prefilled and sent
    cfg = _cfg(tmp_path, [0.0, 10.0, 20.0], [2048, 2560, 2048],
               [[1, 2, 3, 4], [1, 2, 3, 4, 9], [1, 2, 3, 4]])
    (row,), _ = run_all(cfg)
    log = _log(tmp_path)
    assert log["sent_tokens"].tolist() == [2048, 512, 512]
    assert log["prefix_hit_tokens"].tolist() == [0, 2048, 1536]
    assert log["prefill_hit_tokens"].tolist() == [0, 2048, 1536]
    m = cfg.model
    assert log["total_bytes"].tolist() == [_wire(2048, m), _wire(512, m), _wire(512, m)]
    tm = TimingModel(m, cfg.hardware)
    prefill = (log["prefill_end_t"] - log["prefill_start_t"]).tolist()
    assert prefill[0] == pytest.approx(tm.prefill_s(2048), rel=1e-12)
    assert prefill[1] == pytest.approx(tm.prefill_step_s([(512, 2048)]), rel=1e-12)
    assert prefill[2] == pytest.approx(tm.prefill_step_s([(512, 1536)]), rel=1e-12)
    # memory asked on the decode instance: the tokens not held (context + output - hit)
    assert log["decode_kv_bytes"].tolist() == [2048 * (2048 + 130), 2048 * (2560 + 130 - 2048),
                                               2048 * (2048 + 130 - 1536)]
    assert row["prefix_eligible_blocks"] == 3 + 4 + 3
    assert row["prefix_hit_rate"] == pytest.approx(7 / 10)
    assert row["prefix_prefill_hit_rate"] == pytest.approx(7 / 10)
    saved = _wire(2560, m) - _wire(512, m) + _wire(2048, m) - _wire(512, m)
    assert row["prefix_bytes_not_sent"] == saved
    full = 2 * _wire(2048, m) + _wire(2560, m)
    assert row["prefix_bytes_saved_fraction"] == pytest.approx(saved / full)
    # the decode side's reuse alone: a prefill side without a cache prefills it all
    cfg.prefix_cache = replace(cfg.prefix_cache, prefill_capacity_gb=0.0)
    run_all(cfg)
    log = _log(tmp_path)
    assert log["prefix_hit_tokens"].tolist() == [0, 2048, 1536]
    assert log["prefill_hit_tokens"].tolist() == [0, 0, 0]
    assert (log["prefill_end_t"] - log["prefill_start_t"])[1] == \
        pytest.approx(tm.prefill_s(2560), rel=1e-12)


def test_a_shared_store_serves_the_blocks_the_decode_instance_lacks(tmp_path):
    # no decode cache, no prefill cache: r0's prefill writes blocks 1-4 to the store; r1
    # (r0's prompt + one block) fetches them over the store's 0.1 Gbps link from its
    # transfer's set-up, its prefill's end under the seeds' monolithic transfer (4 x 1 MiB +
    # 1 ms: 0.336 s, longer than its 512 tokens' transfer) and decodes once they are in; r2
    # finds 1-4 in the store again
    cfg = _cfg(tmp_path, [0.0, 10.0, 20.0], [2048, 2560, 2560],
               [[1, 2, 3, 4], [1, 2, 3, 4, 9], [1, 2, 3, 4, 7]], decode_capacity_gb=0.0,
               prefill_capacity_gb=0.0, store_capacity_gb=10 * BLOCK_BYTES / 1e9,
               store_gbps=0.1, store_latency_s=0.001)
    (row,), _ = run_all(cfg)
    log = _log(tmp_path)
    assert log["store_hit_tokens"].tolist() == [0, 2048, 2048]
    assert log["prefix_hit_tokens"].tolist() == [0, 0, 0]
    assert log["sent_tokens"].tolist() == [2048, 512, 512]
    fetch_s = 0.001 + 4 * BLOCK_BYTES * 8 / 0.1e9
    assert log["decode_start_t"][1] == pytest.approx(log["prefill_end_t"][1] + fetch_s,
                                                     rel=1e-12)
    assert log["decode_kv_bytes"][1] == 2048 * (2560 + 130)  # fetched blocks need memory
    assert row["prefix_store_hit_rate"] == pytest.approx(8 / 11)
    assert row["prefix_store_fetched_bytes"] == 8 * BLOCK_BYTES
    assert row["prefix_bytes_not_sent"] == 2 * (_wire(2560, cfg.model) - _wire(512, cfg.model))
    # a store of 2 blocks: r0's prefill keeps 1 and 2 (3 finds no room), so r1 fetches 2
    cfg.prefix_cache = replace(cfg.prefix_cache, store_capacity_gb=2 * BLOCK_BYTES / 1e9)
    run_all(cfg)
    assert _log(tmp_path)["store_hit_tokens"].tolist() == [0, 1024, 1024]


def test_a_bounded_decode_cache_evicts_the_least_recent_tail_first(tmp_path):
    # room for 3 blocks: r0 keeps blocks 1, 2, 3 (4 finds none); r1 needs 2 more: 3, then 2
    # go (r0's tail first), so r2 (r0's prompt) finds block 1 alone
    cfg = _cfg(tmp_path, [0.0, 10.0, 20.0], [2048, 1024, 2048],
               [[1, 2, 3, 4], [5, 6], [1, 2, 3, 4]],
               decode_capacity_gb=3 * BLOCK_BYTES / 1e9, prefill_capacity_gb=0.0)
    (row,), _ = run_all(cfg)
    assert _log(tmp_path)["prefix_hit_tokens"].tolist() == [0, 0, 512]
    # r2 keeps 2, 3 and 4 after its hit on 1: 5 and 6 go, then 4 finds no room
    assert row["prefix_evicted_blocks"] == 2 + 2


def test_admission_evicts_idle_blocks_when_a_request_needs_the_room(tmp_path):
    # decode memory beside the weights: 6 MB. r0 leaves its 4 blocks (4.19 MB) behind; r1
    # (another prompt) needs 4.46 MB: 3 idle blocks give way, and it waits for nothing
    cfg = _cfg(tmp_path, [0.0, 10.0], [2048, 2048], [[1, 2, 3, 4], [5, 6, 7, 8]],
               prefill_capacity_gb=0.0)
    cfg.hardware = replace(cfg.hardware, memory_gb=(cfg.model.weight_bytes + 6e6) / 1e9)
    (row,), _ = run_all(cfg)
    assert _log(tmp_path)["memory_wait_s"].tolist() == [0.0, 0.0]
    assert row["prefix_evicted_blocks"] == 3


def test_kv_aware_routing_finds_the_instance_holding_the_prefix(tmp_path):
    # r0 and r1 overlap in time: r0 to decode 0, r1 to decode 1; r2 repeats r1's prompt
    cfg = _cfg(tmp_path, [0.0, 0.0, 10.0], [2048, 2048, 2048],
               [[1, 2, 3, 4], [5, 6, 7, 8], [5, 6, 7, 8]], prefill_capacity_gb=0.0)
    cfg.workload = replace(cfg.workload, decode_nodes=2)
    hits = {}
    for routing in ("least_loaded", "kv_aware"):
        cfg.workload = replace(cfg.workload, routing=routing)
        run_all(cfg)
        hits[routing] = _log(tmp_path)["prefix_hit_tokens"].tolist()
    assert hits == {"least_loaded": [0, 0, 0], "kv_aware": [0, 0, 1536]}


@pytest.mark.parametrize("deserializer, chunk_tokens, ingress_gbps", [
    ("shared", 0, 0.0), ("on_demand", 700, 0.0), ("on_arrival", 0, 0.3), ("node", 700, 0.3)])
def test_without_repeated_blocks_reuse_changes_nothing(tmp_path, deserializer, chunk_tokens,
                                                       ingress_gbps):
    """Every block id distinct: every number is today's (to rounding), whatever the routing
    reads, with requests waiting for decode memory that idle blocks hold (evicted for them)."""
    rng = np.random.default_rng(3)
    n = 40
    arrivals = np.cumsum(rng.exponential(0.02, n)).tolist()
    contexts = rng.integers(600, 4000, n).tolist()
    blocks, next_id = [], 0
    for c in contexts:
        k = -(-c // BLOCK)
        blocks.append(list(range(next_id, next_id + k)))
        next_id += k
    lynx = {"name": "lynx", "label": "lynx"}
    rows = {}
    for enabled, routing in ((False, "least_loaded"), (True, "least_loaded"), (True, "kv_aware")):
        cfg = _cfg(tmp_path, arrivals, contexts, blocks, codecs=("bf16", lynx))
        cfg.deserializer = deserializer
        cfg.workload = replace(cfg.workload, prefill_nodes=2, decode_nodes=2, routing=routing,
                               prefill_chunk_tokens=chunk_tokens, decode_max_batch=6)
        cfg.prefix_cache = replace(cfg.prefix_cache, enabled=enabled)
        cfg.link = replace(cfg.link, bandwidth_gbps=0.2, decode_ingress_gbps=ingress_gbps)
        cfg.hardware = replace(cfg.hardware, memory_gb=(cfg.model.weight_bytes + 20e6) / 1e9)
        rows[enabled, routing], _ = run_all(cfg)
    assert rows[False, "least_loaded"][0]["memory_wait_pct_s"]["p99"] > 0  # memory is tight
    assert rows[True, "least_loaded"][0]["prefix_evicted_blocks"] > 0
    # (and the simulator's event count: a monolithic transfer's set-up with reuse on is a
    # timer of its own, at its prefill's end)
    volatile = ("wall_s", "events_per_s", "events")
    for reuse in (rows[True, "least_loaded"], rows[True, "kv_aware"]):
        for off, on in zip(rows[False, "least_loaded"], reuse, strict=True):
            assert on["prefix_hit_rate"] == 0.0 and on["prefix_bytes_not_sent"] == 0.0
            for key, value in off.items():
                if key not in volatile:
                    assert _same(on[key], value), key


def _same(a, b) -> bool:
    """Equal, floats to their last bits (a monolithic transfer's set-up with reuse on is a
    timer at its prefill's end, which lands within rounding of it), NaN equal to NaN."""
    if isinstance(b, dict):
        return isinstance(a, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in b)
    if isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(b, float):
        return b != b and a != a or a == pytest.approx(b, rel=1e-12, abs=1e-15)
    return a == b


def test_requests_waiting_on_pinned_blocks_do_not_stall_the_instance(tmp_path):
    # 6 MB of decode memory. r0 leaves blocks 1-4 (4.19 MB) idle; r1 (another prompt) needs
    # 4.46 MB; r2 (r0's prompt + 1 block) arrives right after it and pins 1-4 at its
    # transfer's set-up (layer-wise: its prefill's start, right after r1's prefill), before r1
    # is in; it then waits for memory behind r1, which can only fit once r2 has run and
    # unpinned them: r2 goes first
    cfg = _cfg(tmp_path, [0.0, 10.0, 10.001], [2048, 2048, 2560],
               [[1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 4, 9]], prefill_capacity_gb=0.0)
    cfg.transfer = "layerwise"
    cfg.hardware = replace(cfg.hardware, memory_gb=(cfg.model.weight_bytes + 6e6) / 1e9)
    (row,), _ = run_all(cfg)
    log = _log(tmp_path)
    assert log["prefix_hit_tokens"].tolist() == [0, 0, 2048]
    assert log["decode_start_t"][2] < log["decode_start_t"][1]
    assert log["memory_wait_s"][1] > 0
    # r2 longer: it needs 2.01 MB beside the 4.19 MB it pins (1.8 MB are free), and r1
    # waits for those blocks; nothing runs to free memory: a clear error, not a hang
    cfg.workload = replace(cfg.workload, arrivals_context_tokens=[2048, 2048, 2900],
                           arrivals_prefix_blocks=[[1, 2, 3, 4], [5, 6, 7, 8],
                                                   [1, 2, 3, 4, 9, 10]])
    with pytest.raises(ValueError, match=r"stalled with 2 of 3 requests unfinished.*decode0: "
                                         r"2 waiting.*0\.004 GB of prefix blocks pinned"):
        run_all(cfg)


def test_a_reused_head_outlives_its_tail_on_both_sides(tmp_path):
    """A second turn extends the first ([1, 2] then [1, 2, 3, 4]); an unrelated prompt then
    needs room in a 4-block cache: the tail (4) goes, not the head, so the third turn finds
    1, 2, 3 on the prefill instance and on the decode instance. A block another request
    gave the decode cache meanwhile is shared, not held twice."""
    blocks = [[1, 2, 9], [1, 2, 3, 4, 9], [7, 9], [1, 2, 3, 4, 5, 9]]
    cfg = _cfg(tmp_path, [0.0, 10.0, 20.0, 30.0], [1100, 2100, 1000, 3000], blocks,
               decode_capacity_gb=4 * BLOCK_BYTES / 1e9,
               prefill_capacity_gb=4 * BLOCK_BYTES / 1e9)
    run_all(cfg)
    log = _log(tmp_path)
    assert log["prefill_hit_tokens"].tolist() == [0, 1024, 0, 1536]
    assert log["prefix_hit_tokens"].tolist() == [0, 1024, 0, 1536]


def test_reuse_settings_are_checked_before_a_run(tmp_path):
    cfg = _cfg(tmp_path, [0.0], [1000], [[1, 2]])
    cfg.prefix_cache = replace(cfg.prefix_cache, enabled=False)
    cfg.workload = replace(cfg.workload, routing="kv_aware")
    with pytest.raises(ValueError, match="prefix_cache.enabled=true"):
        cfg.validate()
    cfg = _cfg(tmp_path, [0.0], [1000], [[1, 2, 3]])
    with pytest.raises(ValueError, match="3 prefix block ids for 1000 tokens"):
        run_all(cfg)
    cfg = _cfg(tmp_path, [0.0], [1000], [])
    with pytest.raises(ValueError, match="names no prefix blocks"):
        run_all(cfg)
    cfg = _cfg(tmp_path, [0.0, 1.0], [1000, 1000], [[1, 2]])
    with pytest.raises(ValueError, match="one list per request"):
        cfg.validate()


# ---- the emulator's prefix delta ---------------------------------------------------------
PAGE_LOCAL = ["bf16", "int8", "int4", "lynx", "lynx-2+2+4", "lynx-int8", "lynx-oscar"]


@pytest.mark.parametrize("preset", PAGE_LOCAL)
@pytest.mark.parametrize("prefix_pages", [2, 4])
def test_codecs_that_say_their_pages_encode_alone_do(preset, prefix_pages):
    """pages_encode_alone() lets a decode node reuse an earlier request's chunks of a shared
    prefix and a sender encode only the rest: the chunks of the pages after a page boundary
    must be the same bytes with or without the cache before them (here a suffix of 588 and
    of 76 tokens)."""
    import torch

    from kvsim.core.layout import KVShape
    from kvsim.kernels.presets import resolve_codec

    codec = resolve_codec(preset).build()
    assert codec.pages_encode_alone()
    pt = codec.page_tokens(KVShape(layers=2, tokens=1100, kv_heads=2, head_dim=64))
    kv = torch.randn(2, 2, 2, 1100, 64, generator=torch.Generator().manual_seed(1)) \
        .to(torch.bfloat16)
    whole = codec.encode(kv)
    tail = codec.encode(kv[:, :, :, prefix_pages * pt:, :].contiguous())
    for a, b in zip(whole.streams, tail.streams, strict=True):
        later = {(c.layer, c.page): np.asarray(c.payload) for c in a if c.page >= prefix_pages}
        assert len(later) == len(b)
        for c in b:
            assert np.array_equal(later[(c.layer, c.page + prefix_pages)],
                                  np.asarray(c.payload)), (c.layer, c.page)


def test_codecs_whose_pages_depend_on_the_rest_do_not_say_so():
    """Per-tensor scales, KIVI's windows and groups along tokens, GEAR's low rank, CacheGen's
    coding across the cache: their chunks of a page can change with what else the cache
    holds, so the emulator refuses prefix reuse with them."""
    from kvsim.kernels.presets import resolve_codec

    for preset in ("int8-tensor", "kivi-2", "kcvt-4", "gear", "oscar", "cachegen"):
        assert not resolve_codec(preset).build().pages_encode_alone(), preset


def _emulated(*overrides: str):
    from test_transport import config  # the transport tests' base: synthetic KV, timing decode

    return config("codecs=[int8]", "transfer=layerwise", "workload.kind=trace",
                  "workload.arrivals_t=[0,6,12]",
                  "workload.arrivals_context_tokens=[1024,1536,1024]",
                  "workload.arrivals_prefix_blocks=[[1,2],[1,2,3],[1,2]]",
                  "prefix_cache.enabled=true", "prefix_cache.prefill_capacity_gb=0", *overrides)


def test_the_emulator_sends_only_the_blocks_its_decode_node_lacks(tmp_path):
    """Three requests over loopback: the second repeats the first's two blocks, the third
    the first's prompt (a hit stops one block short of it). The decode node preloads the
    blocks it holds, the sender encodes and sends only the pages after them: the same hits
    and the same wire bytes as the simulator's prefix delta."""
    from test_transport import send
    from transport_harness import RunningReceiver

    from kvsim.kernels.presets import resolve_codec
    from kvsim.transport import protocol as P
    from kvsim.transport.rate_limiter import TokenBucket

    cfg = _emulated()
    with RunningReceiver(cfg) as rx:
        results = send(cfg, rx.endpoint, TokenBucket(0.5))
        assert rx.prefix_store is not None and rx.prefix_store.held_bytes > 0
    assert [r.status for r in results] == ["done"] * 3, [r.error for r in results]
    assert [r.row["prefix_hit_tokens"] for r in results] == [0, 1024, 512]
    assert [r.prefix_tokens for r in results] == [0, 1024, 512]
    assert all(r.row["chunks_received"] == r.row["chunks_expected"] for r in results)
    cfg.requests_path, cfg.min_samples = str(tmp_path / "r.csv"), 1
    run_all(cfg)
    log = _log(tmp_path)
    assert log["prefix_hit_tokens"].tolist() == [0, 1024, 512]
    codec = resolve_codec("int8").build()
    for res, sent in zip(results, log["sent_tokens"].tolist(), strict=True):
        table = codec.size_table(cfg.model.kv_shape(sent))
        chunks = int((table.chunk_bytes > 0).sum())
        # the simulator's delta (chunk frames + preamble) = what the sender sent (chunk
        # frames, each behind its control frame)
        assert res.sent_bytes == table.total_bytes - table.header_bytes + \
            chunks * P.CONTROL_BYTES
        assert log["total_bytes"][res.row["seq"]] == table.total_bytes


@pytest.mark.parametrize("name, mode", [("uniform", "on_arrival"), ("uniform", "on_demand"),
                                        ("lynx", "on_arrival"), ("lynx", "on_demand")])
def test_a_held_prefix_is_neither_sent_nor_dequantized_again(name, mode):
    """A decode node holds the first 256 tokens (one block, one page) of a 600-token cache,
    dequantized (bf16): the request is sent the other pages only, and its cache is the held
    tokens, then those pages decoded (the whole cache's decode there). Once its cache is
    dequantized whole, it gives its own full block (tokens 256-511) to the store, in bf16."""
    import torch
    from test_transport_on_arrival import SHAPE, _frames

    from kvsim.kv.synthetic import generate_kv
    from kvsim.transport.assembly import Assembly
    from kvsim.transport.prefix_store import HeldPrefix, PrefixUse

    codec = make_codec(name)
    enc = codec.encode(generate_kv(SHAPE, seed=5))
    n = codec.num_streams
    whole = codec.decode(enc, streams=n, dtype=torch.float32)
    held = whole[:, :, :, :256].to(torch.bfloat16)
    asm = Assembly(7, codec, SHAPE, codec.size_table(SHAPE), {}, dequantize=mode,
                   anchor_needed=n > 1)
    use = PrefixUse("k", (1, 2, 3), 256, float(held.nbytes), SHAPE.layers, SHAPE.tokens)
    use.hit = 1
    given = []
    asm.on_full_layer = lambda layer, kv: given.append(use.give_layer(layer, kv))
    asm.preload(HeldPrefix([held], 256, 256))
    assert asm.held_tokens == 256
    assert [st.count for st in asm.streams] == [SHAPE.layers] * n  # page 0 of every layer
    asm.start()
    for f in _frames(enc, 7):
        if f.page > 0:
            assert asm.add(f, f.payload.nbytes) == "ok"
    assert asm.wait_streams(n, timeout_s=30)
    kv = asm.kv(n)
    assert torch.equal(kv[:, :, :, 256:], whole[:, :, :, 256:])
    assert torch.equal(kv[:, :, :, :256], held.float())
    if mode == "on_arrival":  # the worker dequantized the two pages after the held one
        assert {name.split(" streams")[0].split(" stream")[0] for name, _, _ in
                asm.dequantizer.spans} == {f"dequantize layer {i}" for i in range(SHAPE.layers)}
    blocks = [b for b in given if b is not None]
    assert len(blocks) == 1 and len(blocks[0]) == 1 and use.given
    assert torch.equal(blocks[0][0], whole[:, :, :, 256:512].to(torch.bfloat16))
    asm.close()
    with pytest.raises(ValueError, match="not whole pages"):
        Assembly(8, codec, SHAPE, codec.size_table(SHAPE), {}).preload(
            HeldPrefix([held[:, :, :, :100]], 100, 256))


def test_the_decode_node_checks_a_hellos_prefix():
    from kvsim.core.layout import KVShape
    from kvsim.kernels.presets import resolve_codec
    from kvsim.transport.prefix_store import prefix_of

    shape = KVShape(layers=2, tokens=1100, kv_heads=2, head_dim=64)
    int8 = resolve_codec("int8").build()
    ok = {"blocks": [4, 5, 6], "block_tokens": 512}
    use = prefix_of({"prefix": ok}, int8, shape, 256)
    assert use.blocks == (4, 5, 6) and use.full == 2  # the third block is partial
    assert use.block_bytes == 2 * 2 * 2 * 512 * 64 * 2  # layers x K,V x heads x tokens x dim, bf16
    assert prefix_of({}, int8, shape, 256) is None
    for bad, match in ((dict(ok, blocks=[4, 5]), "3 integer ids"),
                       (dict(ok, blocks=[4, 5, "x"]), "integer ids"),
                       (dict(ok, block_tokens=384), "multiple"),
                       (dict(ok, block_tokens=True), "block_tokens"),
                       ({"blocks": [1]}, "object of blocks")):
        with pytest.raises(ValueError, match=match):
            prefix_of({"prefix": bad}, int8, shape, 256)
    kivi = resolve_codec("kivi-2").build()
    with pytest.raises(ValueError, match="pages encode alone"):
        prefix_of({"prefix": ok}, kivi, shape, 256)


@pytest.mark.parametrize("override, match", [
    ("transport.decode=auto", "transport.decode=timing"),
    ("prefix_cache.prefill_capacity_gb=1", "prefill_capacity_gb=0"),
    ("prefix_cache.store_capacity_gb=1", "store_capacity_gb=0"),
    ("codecs=[kivi-2]", "pages encode alone"),
])
def test_the_transport_refuses_reuse_it_does_not_emulate(override, match):
    with pytest.raises(ValueError, match=match):
        _emulated(override)


def test_validates_prefix_case_replays_conversations_whose_turns_reuse_their_prompt(tmp_path):
    """kvsim validate prefix.enabled=true: 3 conversations x 3 turns; every later turn finds
    the earlier turn's whole prompt on the decode instance (the simulator's side of the
    comparison, run here), and the engines must agree on every request's reuse."""
    from kvsim.core.compose import compose
    from kvsim.fidelity.validation import PrefixCaseConfig, _prefix_rows, _prefix_scenario

    p = PrefixCaseConfig()
    keys = [k for k in _prefix_scenario(p)[2] if not k.startswith("transport.")]
    cfg, _ = compose("sim", ["scenario=none", "model=smollm2-135m", "hardware=local-cpu",
                             "codecs=[int8]", "link.bandwidth_gbps=0.2", "min_samples=1",
                             f"requests_path={tmp_path / 'r.csv'}", *keys], SimConfig)
    (row,), _ = run_all(cfg)
    log = _log(tmp_path)
    assert log["arrival_t"].tolist() == [0, 4, 8, 20, 24, 28, 40, 44, 48]
    assert log["context_tokens"].tolist() == [768] * 3 + [1024] * 3 + [1280] * 3
    hits = log["prefix_hit_tokens"].tolist()
    assert hits[0] == 0 and set(hits[1:3]) <= {0, 256}  # the shared first block, if in
    assert hits[3:] == [768] * 3 + [1024] * 3  # the previous turn's whole prompt
    measured = {"int8": {"per_request": [{"seq": q, "prefix_hit_tokens": h}
                                         for q, h in enumerate(hits)]}}
    measured["int8"]["per_request"][4]["prefix_hit_tokens"] = 0
    with pytest.raises(ValueError, match="reused different prompt tokens"):
        _prefix_rows(p, measured, {"int8": row}, tmp_path / "r.csv", 9)


def test_a_prefix_cases_rows_have_no_rate_and_print():
    from kvsim.fidelity import errors

    row = {"emulation": "token_bucket", "bandwidth_gbps": 0.2, "context_tokens": 768,
           "rate_per_s": None, "codec": "int8", "metric": "ttft", "pairs": 9,
           "mape_pct": 0.2, "pearson_r": 1.0, "ks_statistic": 0.3, "ks_p": 0.7}
    assert "| token_bucket | 0.2 | 768 | - | int8 | ttft | 9 | 0.20 |" in \
        errors.distributions_table([row])


def test_burstgpt_csv_is_read_without_its_failed_requests(tmp_path):
    """BurstGPT's columns (Timestamp s, Request tokens, Response tokens, and three not read);
    a failed request (Response tokens 0) is left out, an error names the file's row."""
    path = tmp_path / "burst.csv"
    pd.DataFrame({"Timestamp": [5.0, 6.5, 7.0, 9.0], "Model": ["ChatGPT"] * 4,
                  "Request tokens": [300, 1200, 40, 700],
                  "Response tokens": [20, 0, 310, 55], "Total tokens": [320, 1200, 350, 755],
                  "Log Type": ["Conversation log"] * 4}).to_csv(path, index=False)
    tr = read_trace(path)
    assert tr.arrival_s.tolist() == [0.0, 2.0, 4.0]
    assert tr.context_tokens.tolist() == [300, 40, 700]
    assert tr.output_tokens.tolist() == [20, 310, 55] and tr.prefix_blocks is None
    bad = pd.read_csv(path)
    bad.loc[3, "Request tokens"] = 0
    bad.to_csv(path, index=False)
    with pytest.raises(ValueError, match="Request tokens row 3 is '0', not an integer"):
        read_trace(path)
