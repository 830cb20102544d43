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


def test_a_host_that_has_exited_or_was_closed_is_refused_as_is_another_link(monkeypatch):
    """A kept host whose serve died is refused (RuntimeError), as is one whose context has
    ended; a tc run is refused by a loopback host, a tc host where this machine cannot make
    namespaces (saying why), and so is a configuration whose state would carry from one
    run into the next (a prefix store, several decode instances)."""
    from kvsim.transport import netns

    cfg = config("codecs=[int8]")
    with DecodeHost(cfg) as host:
        emulate(cfg, host)  # started
        host._serve.kill()
        host._serve.wait(timeout=30)
        with pytest.raises(RuntimeError, match="not running"):
            emulate(cfg, host)
        with pytest.raises(ValueError, match="decode side differs from the decode host kept "
                                             "over runs in link: 'tc' vs 'loopback'"):
            emulate(config("codecs=[int8]", "transport.emulation=tc"), host)
    closed = DecodeHost(cfg)
    with closed:
        pass
    with pytest.raises(RuntimeError, match="not running"):
        emulate(cfg, closed)
    monkeypatch.setattr(netns, "netns_available", lambda: (False, "not root (a stand-in)"))
    with pytest.raises(ValueError, match=r"needs network namespaces: not root \(a stand-in"):
        DecodeHost(config("codecs=[int8]", "transport.emulation=tc"))
    with pytest.raises(ValueError, match="decode_nodes"):
        DecodeHost(config("codecs=[int8]", "workload.decode_nodes=2"))


@pytest.mark.net
def test_one_tc_host_serves_runs_at_two_rates_over_one_reshaped_link():
    """A kept tc host: one `kvsim serve` in the receiver's namespace of one link, the sender
    on a thread of this process in the sender's; a second run at another rate reshapes the
    link first, and each run's goodput is its own rate's (an unreshaped link would give the
    first rate); a loopback run is refused; nothing of the link is left after the host."""
    from kvsim.transport.netns import leftovers, netns_available

    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    first = config("codecs=[int8]", "transport.emulation=tc", "link.bandwidth_gbps=1.0")
    with DecodeHost(first) as host:
        runs = {rate: emulate(config("codecs=[int8]", "transport.emulation=tc",
                                     f"link.bandwidth_gbps={rate}"), host)
                for rate in (1.0, 0.2)}
        namespaces = {host._link.sender_ns, host._link.receiver_ns}
        assert host._link.spec.rate_gbps == 0.2
        with pytest.raises(ValueError, match="in link: 'loopback' vs 'tc'"):
            emulate(config("codecs=[int8]"), host)
    for rate, [row] in runs.items():
        assert row["status"] == "done" and row["link_emulation"] == "tc", row
        assert "sender_id" not in row  # the decode host's row
        # (above the rate: the link was not reshaped; the sender shares 2 cores here)
        assert 0.5 * rate <= row["goodput_gbps"] <= rate, (rate, row["goodput_gbps"])
    assert not namespaces & {item.netns for item in leftovers()}


@pytest.mark.net
def test_a_tc_host_whose_link_cannot_be_reshaped_ends_itself(monkeypatch):
    """A reshape that fails (here: a stand-in raising as `tc` would) ends the kept host:
    the error reaches the run, serve is stopped, the link removed, and a later run is
    refused rather than sent over a link left half-shaped."""
    from kvsim.transport import netns

    ok, why = netns.netns_available()
    if not ok:
        pytest.skip(why)

    def broken(link, spec):
        raise netns.NetnsError("`tc ... qdisc replace` failed (a stand-in)")

    first = config("codecs=[int8]", "transport.emulation=tc", "link.bandwidth_gbps=1.0")
    with DecodeHost(first) as host:
        [row] = emulate(first, host)
        assert row["status"] == "done"
        names = {host._link.sender_ns, host._link.receiver_ns}
        monkeypatch.setattr(netns, "reshaped", broken)
        slower = config("codecs=[int8]", "transport.emulation=tc", "link.bandwidth_gbps=0.2")
        with pytest.raises(netns.NetnsError, match="a stand-in"):
            emulate(slower, host)
        assert host._serve.poll() is not None
        assert not names & {item.netns for item in netns.leftovers()}
        with pytest.raises(RuntimeError, match="not running"):
            emulate(first, host)


def test_a_run_of_its_own_still_runs_end_to_end():
    """emulate without a kept host: a decode host for the run alone, ended by its request
    count (the refactored path of plain `kvsim emulate`)."""
    [row] = emulate(config("codecs=[int8]"))
    assert row["status"] == "done" and row["decode"] == "timing"


def test_validate_keeps_one_host_per_emulation(tmp_path, monkeypatch):
    """kvsim validate's wiring, with a stand-in host and engine: the token bucket's
    scenarios share one host (warmed up for the grid's longest prompt), closed before the
    next emulation's scenarios; tc's share another (where this host can make namespaces);
    the multi-request loads a third."""
    from kvsim.cli.main import main
    from kvsim.fidelity import runner
    from kvsim.transport import emulate as emulate_mod
    from kvsim.transport.netns import netns_available

    made, closed = [], []

    class Host:
        def __init__(self, cfg, max_requests=0, warm_context_tokens=0):
            self.emulation = cfg.transport.emulation
            self.warm = warm_context_tokens
            made.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            closed.append(self)

    used = []

    def pair(common, sim, host=None):
        emulation = next(o for o in common if o.startswith("transport.emulation="))
        used.append((emulation.split("=")[1], host, list(closed)))
        rows = runner.simulate(sim)
        return rows, rows

    monkeypatch.setattr(emulate_mod, "DecodeHost", Host)
    monkeypatch.setattr(runner, "run_pair", pair)
    assert main(["validate", "emulations=[token_bucket,tc]", "rates_gbps=[0.1,0.3]",
                 "contexts=[512,1024]", "codecs=[int8]", "multi.rates_per_s=[0.2,0.5]",
                 "multi.requests=2", "multi.codecs=[int8]", "samples=1", "drift.action=off",
                 "figure=false", f"hydra.run.dir={tmp_path / 'run'}"]) == 0
    if netns_available()[0]:
        tb, tc, multi = made
        assert tc.emulation == "tc" and tc.warm == 1024
    else:
        (tb, multi), tc = made, None
    assert [(e, h) for e, h, _ in used] == [("token_bucket", tb)] * 4 + \
        [("tc", tc)] * (4 if tc else 0) + [("token_bucket", multi)] * 2
    assert tb.warm == 1024 and multi.warm == 0
    # each host was closed before the next emulation's scenarios and the multi-request loads
    assert all(tb in before for e, h, before in used[4:]) and \
        closed == [h for h in (tb, tc, multi) if h is not None]
    if tc:
        assert all(tc in before for e, h, before in used[8:])
