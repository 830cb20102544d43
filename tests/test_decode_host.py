"""A decode host kept over several emulated runs (kvsim.transport.emulate.DecodeHost): one
`kvsim serve` started once, each run's sender connecting to it in turn, as `kvsim validate`
runs one emulation's scenarios."""

from __future__ import annotations

import pytest
from test_transport import config

from kvsim.transport.emulate import DecodeHost, emulate


def test_one_host_decodes_runs_of_several_rates_and_prompts_and_refuses_another_decode_side():
    """Two runs (another rate, a shorter prompt) through one kept host: every request done,
    each row the decode host's own (its decode-side fields), as many rows as requests; a run
    whose decode side differs, a codec the host did not warm up or a prompt longer than it
    warmed up for is refused before anything is sent, naming what differs."""
    first = config("codecs=[int8,lynx]", "link.bandwidth_gbps=0.5")
    with DecodeHost(first, warm_context_tokens=768) as host:
        runs = [emulate(first, host),
                emulate(config("codecs=[int8,lynx]", "link.bandwidth_gbps=2.0",
                               "workload.context_tokens=256"), host)]
        with pytest.raises(ValueError, match="receiver"):
            emulate(config("codecs=[int8]", "transport.dequantize=on_demand"), host)
        with pytest.raises(ValueError, match=r"did not warm up codec\(s\) \['int4'\]"):
            emulate(config("codecs=[int4]"), host)
        with pytest.raises(ValueError, match="1024-token prompt is longer"):
            emulate(config("codecs=[int8]", "workload.context_tokens=1024"), host)
        # the host still serves after the refusals
        again = emulate(config("codecs=[int8]"), host)
    for rows, tokens, rate in ((runs[0], 512, 0.5), (runs[1], 256, 2.0)):
        assert sorted(r["codec"] for r in rows) == ["int8", "lynx"]
        for r in rows:
            assert r["status"] == "done"
            assert (r["context_tokens"], r["bandwidth_gbps"]) == (tokens, rate)
            assert r["decode"] == "timing" and "sender_id" not in r  # the decode host's row
            assert max(r["ttkt_s"].values()) >= r["ttft_s"] > 0
    assert [r["status"] for r in again] == ["done"]


def test_a_host_that_has_exited_is_refused_and_tc_is_not_kept():
    cfg = config("codecs=[int8]")
    host = DecodeHost(cfg)
    with host:
        pass
    with pytest.raises(RuntimeError, match="not running"):
        emulate(cfg, host)
    with pytest.raises(ValueError, match="tc starts one per run"):
        DecodeHost(config("codecs=[int8]", "transport.emulation=tc"))


def test_a_run_of_its_own_still_reports_through_the_hosts_report():
    """emulate without a kept host: a decode host for the run alone, ended by its request
    count, its report's rows."""
    [row] = emulate(config("codecs=[int8]"))
    assert row["status"] == "done" and row["decode"] == "timing"
