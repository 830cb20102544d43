"""Decode host of a real transfer: listen (ZeroMQ ROUTER), accept requests whose codec and
model this node can decode, assemble their streams, decode on them as they arrive
(speculatively on the anchor for split-stream codecs: the real model here, or the hardware
preset's timing model), and write one report row per request. Ctrl-C stops it and keeps
the rows so far, as does SIGTERM."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from kvsim.transport.config import EmulateConfig

COMMAND = ("serve",)
HELP = "decode host of a real KV transfer: receive over ZeroMQ, decode, report rows"
CONFIG_NAME = "transport"
Config = EmulateConfig


def run(cfg: EmulateConfig) -> list[dict]:
    from kvsim.core.wakeup_latency import held_wakeup_latency, report_unheld

    cfg.validate()
    # the host's CPUs held awake while it serves (kvsim.core.wakeup_latency)
    with held_wakeup_latency(cfg.transport.cpu_wakeup_us) as hold:
        report_unheld("kvsim serve", hold)
        return _serve(cfg, hold.held_us)


def _serve(cfg: EmulateConfig, wakeup_held_us: int | None) -> list[dict]:
    import torch

    from kvsim.transport import session
    from kvsim.transport.cpus import pin_listed
    from kvsim.transport.memory import retain_freed_memory
    from kvsim.transport.receiver import Receiver

    pin_listed(cfg.transport.cpus)  # before any thread starts: every later one inherits it
    retain_freed_memory("serve")  # before threads start: one arena, memory kept
    torch.set_num_threads(cfg.transport.threads)
    mode = session.decode_mode(cfg)
    device = session.kv_device(cfg)  # refused here if this host lacks it
    lm = session.load_model(cfg) if mode == "real" else None
    session.warm_up(cfg, lm, decode_side=True)
    from kvsim.transport.metrics import TransportMetrics

    metrics = TransportMetrics("serve")
    rx = Receiver(session.receiver_settings(cfg, cfg.transport.bind),
                  session.decoder_factory(cfg, mode, lm),
                  session.row_builder(mode, device, wakeup_held_us),
                  check_hello=session.hello_checker(
                      cfg, mode, None if lm is None else int(lm.model.config.vocab_size)),
                  metrics=metrics)
    if metrics.start_server(cfg.transport.metrics_port, cfg.transport.metrics_addr):
        print(f"kvsim serve: metrics on http://{cfg.transport.metrics_addr}:"
              f"{cfg.transport.metrics_port}/metrics", file=sys.stderr)

    def announce() -> None:
        rx.bound.wait()
        if rx.endpoint:
            print(f"kvsim serve: listening on {rx.endpoint} (model {cfg.model.name}, "
                  f"{mode} decode on {device})", file=sys.stderr, flush=True)
            if cfg.transport.endpoint_file:
                Path(cfg.transport.endpoint_file).write_text(rx.endpoint + "\n")

    threading.Thread(target=announce, daemon=True).start()
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (kvsim emulate's stop, a parent's death): stop, report what ended so far
        signal.signal(signal.SIGTERM, lambda *_: rx.stop.set())
    try:
        rows = rx.serve()
    except KeyboardInterrupt:
        print(f"kvsim serve: interrupted; {len(rx.rows)} request(s) reported", file=sys.stderr)
        rows = rx.rows
    finally:
        metrics.close()
    if cfg.transport.cpus:  # where the decode side ran (transport.split_cpus / cpus)
        from kvsim.transport.cpus import format_cpus

        rows = [{**r, "decode_cpus": format_cpus(os.sched_getaffinity(0))} for r in rows]
    session.print_rows(rows)
    if rx.refused:
        print(f"refused by code: {dict(rx.refused)}", file=sys.stderr)
    return rows
