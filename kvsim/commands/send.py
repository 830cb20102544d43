"""Prefill host of a real transfer: for each codec (and transfer policy) of the scenario and
each request of its workload, make the KV cache (a live prefill of the real model, a capture,
or synthetic KV of the model preset's shape), encode it layer by layer and send its streams
to `transport.connect`, highest priority first, through the link emulation; print the rows
the decode host reports back. Exits 1, naming why, when a request is not done (peer lost,
refused, aborted); `resume=<that run's report>` then sends only what the decode host lacks
of the requests it still holds."""

from __future__ import annotations

from kvsim.transport.config import EmulateConfig

COMMAND = ("send",)
HELP = "prefill host of a real KV transfer: prefill, encode, send over ZeroMQ"
CONFIG_NAME = "transport"
Config = EmulateConfig


def run(cfg: EmulateConfig) -> dict:
    from kvsim.transport import session
    from kvsim.transport.cpus import pin_listed
    from kvsim.transport.emulate import failures, send_all

    pin_listed(cfg.transport.cpus)  # before any thread starts: every later one inherits it
    rows = send_all(cfg)
    session.print_rows(rows)
    return {"rows": rows, "failed": failures(rows)}
