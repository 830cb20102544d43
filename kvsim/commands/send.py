"""Prefill host of a real transfer: for each codec (and transfer policy) of the scenario and
each request of its workload, make the KV cache (a live prefill of the real model, a capture,
or synthetic KV of the model preset's shape), encode it layer by layer and send its streams
to `transport.connect`, highest priority first, through the link emulation; print the rows
the decode host reports back."""

from __future__ import annotations

from kvsim.config.transport import EmulateConfig

COMMAND = ("send",)
HELP = "prefill host of a real KV transfer: prefill, encode, send over ZeroMQ"
CONFIG_NAME = "transport"
Config = EmulateConfig


def send_all(cfg: EmulateConfig) -> list[dict]:
    import torch

    from kvsim.transport import session
    from kvsim.transport.memory import retain_freed_memory
    from kvsim.transport.sender import Sender

    cfg.validate()
    retain_freed_memory("send")  # before threads start: one arena, memory kept
    torch.set_num_threads(cfg.transport.threads)
    lm = session.load_model(cfg) if session.source_kind(cfg) == "live" else None
    session.warm_up(cfg, lm)
    rows = []
    for batch in session.outgoing_requests(cfg, lm):
        t = cfg.transport
        sender = Sender(t.connect, session.limiter_for(cfg), cfg.link.scheduling, t.timeout_s,
                        t.heartbeat_s, t.max_queued_bytes,
                        max_in_flight_bytes=session.max_in_flight_bytes(cfg),
                        residual_weight=cfg.link.residual_weight,
                        residual_age_s=cfg.link.residual_age_s)
        for res in sender.run(batch):
            rows.append(res.row if res.row is not None else {
                "request_id": res.request_id, "codec": res.codec, "status": res.status,
                "error": res.error, "chunks": res.chunks, "acked": res.acked,
                "sent_bytes": res.sent_bytes})
    return rows


def run(cfg: EmulateConfig) -> list[dict]:
    from kvsim.transport import session

    rows = send_all(cfg)
    session.print_rows(rows)
    return rows
