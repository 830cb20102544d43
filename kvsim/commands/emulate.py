"""A real transfer on this machine, in one command: a `kvsim serve` process (decode host) and a
sender (prefill host) in this process, over loopback with a token-bucket link
(`transport.emulation=token_bucket`, the default), unshaped (`none`), or over two network
namespaces joined by a `tc`-shaped veth pair (`tc`; needs root) as two hosts: kvsim serve in
the receiver's namespace, the sender on a thread joined to the sender's.
Several codecs in one call, as `kvsim sim`; the rows are the decode host's, with the same
fields as `kvsim sim` rows plus committed-token times and measured goodput."""

from __future__ import annotations

import sys

from kvsim.transport.config import EmulateConfig

COMMAND = ("emulate",)
HELP = "real KV transfer between two processes here (loopback token bucket or tc namespaces)"
CONFIG_NAME = "transport"
Config = EmulateConfig


def run(cfg: EmulateConfig) -> list[dict]:
    from kvsim.calibrate.host_probe import check_host
    from kvsim.transport import session
    from kvsim.transport.emulate import emulate
    from kvsim.transport.record import aggregate_rows

    cfg.validate()  # a bad config fails before the probe's ~12 s
    # a measured profile from another host: its modelled times (prefill, timing-model
    # decode) rescaled to this host's step first, both ends then reading the rescaled copy
    drift = check_host(cfg, "kvsim emulate", own_process=True)
    per_request = emulate(cfg)
    rows = aggregate_rows(per_request)
    if drift is not None:
        for r in rows:
            r.update(drift.row_keys())
    session.print_rows(rows)
    if drift is not None:
        print(f"host: {drift.words()}")
    if cfg.trace_path:
        trace = session.trace_of(per_request)
        trace.write(cfg.trace_path)
        print(f"event log ({len(trace.events)} spans) written to {cfg.trace_path}",
              file=sys.stderr)
    return rows
