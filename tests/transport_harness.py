"""An in-process decode host for transport tests: kvsim's Receiver serving `cfg` (its
settings, with `limits` replacing any of them) in a background thread on an ephemeral
loopback port."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from kvsim.transport import session
from kvsim.transport.config import EmulateConfig
from kvsim.transport.receiver import Receiver


class RunningReceiver:
    def __init__(self, cfg: EmulateConfig, metrics: Any = None,
                 log: Callable[[str], None] | None = None, **limits: Any) -> None:
        mode = session.decode_mode(cfg)
        settings = dataclasses.replace(session.receiver_settings(cfg, "tcp://127.0.0.1:*"),
                                       **limits)
        self.cfg = cfg
        self.rx = Receiver(settings, session.decoder_factory(cfg, mode, None),
                           session.row_builder(mode), log=log or (lambda m: None),
                           check_hello=session.hello_checker(cfg, mode), metrics=metrics)
        self.thread = threading.Thread(target=self.rx.serve, daemon=True,
                                       name="test-receiver")

    def start(self) -> RunningReceiver:
        self.thread.start()
        assert self.rx.bound.wait(10)
        return self

    def stop(self) -> bool:
        """Tell the receiver to stop; whether its thread ended within 10 s."""
        self.rx.stop.set()
        self.thread.join(10)
        return not self.thread.is_alive()

    def __enter__(self) -> Receiver:
        return self.start().rx

    def __exit__(self, *exc) -> None:
        assert self.stop()
