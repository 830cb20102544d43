"""Both ends of a real transfer on this machine (what `kvsim emulate` runs): a `kvsim serve`
process (decode host) and the sender (prefill host, `send_all`, also `kvsim send`), over
loopback with a token-bucket link (`transport.emulation=token_bucket`, the default),
unshaped (`none`), or over two network namespaces joined by a `tc`-shaped veth pair (`tc`;
needs root): `kvsim serve` in the receiver's namespace, the sender on a thread of this
process joined to the sender's, as two hosts."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvsim.transport.children import popen, stop
from kvsim.transport.config import EmulateConfig

if TYPE_CHECKING:
    from kvsim.transport.netns import NetemSpec, NetnsLink


def send_all(cfg: EmulateConfig, metrics_port: int | None = None, kernel_threads: int = 0
             ) -> list[dict]:
    """Every request of the scenario, one sender per (codec, transfer) variant; the decode
    host's row of each, or the sender's own where none came (with its status and why).
    metrics_port: where the sender's metrics are served (None: transport.metrics_port);
    kernel_threads: the threads the encoders' parallel kernels use (Sender; 0: all)."""
    import torch

    from kvsim.core.gc_freeze import frozen_heap
    from kvsim.core.wakeup_latency import held_wakeup_latency, report_unheld
    from kvsim.transport import protocol as P
    from kvsim.transport import session
    from kvsim.transport.memory import retain_freed_memory
    from kvsim.transport.metrics import TransportMetrics
    from kvsim.transport.sender import Sender
    from kvsim.transport.source import forget_prefills

    cfg.validate()
    retain_freed_memory("send")  # before threads start: one arena, memory kept
    torch.set_num_threads(cfg.transport.threads)
    resume = session.resume_plan(cfg.resume) if cfg.resume else None
    lm = session.load_model(cfg) if session.source_kind(cfg) == "live" else None
    session.warm_up(cfg, lm)
    rows = []
    t = cfg.transport
    metrics = TransportMetrics("send")
    port = t.metrics_port if metrics_port is None else metrics_port
    if metrics.start_server(port, t.metrics_addr):
        print(f"kvsim send: metrics on http://{t.metrics_addr}:{port}/metrics",
              file=sys.stderr)
    try:
        # this process's objects out of the collector's passes while it sends
        # (kvsim.core.gc_freeze), the host's CPUs held awake (kvsim.core.wakeup_latency)
        with frozen_heap(), held_wakeup_latency(t.cpu_wakeup_us) as hold:
            report_unheld("kvsim send", hold)
            for variant, batch in enumerate(session.outgoing_requests(cfg, lm, resume)):
                sender = Sender(t.connect, session.limiter_for(cfg), cfg.link.scheduling,
                                t.timeout_s, t.heartbeat_s, t.max_queued_bytes,
                                identity=resume.identities.get(variant) if resume else None,
                                max_in_flight_bytes=session.max_in_flight_bytes(cfg),
                                behind_in_flight_bytes=session.behind_in_flight_bytes(cfg),
                                residual_weight=cfg.link.residual_weight,
                                residual_age_s=cfg.link.residual_age_s, keys=t.keys,
                                insecure=t.insecure, metrics=metrics,
                                prefill=session.prefill_instances(cfg),
                                kernel_threads=kernel_threads)
                for out, res in zip(batch, sender.run(batch), strict=True):
                    rows.append(res.row if res.row is not None else {
                        "request_id": P.id_hex(res.request_id), "variant": variant,
                        "seq": out.arrival_seq, "codec": res.codec, "status": res.status,
                        "error": res.error, "chunks": res.chunks, "acked": res.acked,
                        "sent_bytes": res.sent_bytes, "skipped_chunks": res.skipped_chunks,
                        # the routing id its requests belong to on the decode host: what
                        # `kvsim send resume=<this report>` presents again
                        "sender_id": sender.identity.hex()})
    finally:
        metrics.close()
        forget_prefills()  # reuse_prefill spans this run's requests only
    return rows


def failures(rows: list[dict]) -> str:
    """'' if every request is done, else how many are not and why (the first of each
    status)."""
    bad = [r for r in rows if r.get("status") != "done"]
    if not bad:
        return ""
    first = {}
    for r in bad:
        first.setdefault(r.get("status"), str(r.get("error") or "")[:200])
    why = "; ".join(f"{status}: {error}" for status, error in first.items())
    return f"{len(bad)} of {len(rows)} request(s) not done ({why})"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(cmd: str, cfg: EmulateConfig, tmp: Path, report: Path) -> list[str]:
    path = tmp / f"{cmd}.json"
    path.write_text(json.dumps(dataclasses.asdict(cfg)))
    return [sys.executable, "-m", "kvsim", cmd, f"--resolved={path}", f"report={report}"]


def _wait_listening(proc: subprocess.Popen, endpoint_file: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not endpoint_file.is_file() or not endpoint_file.read_text().strip():
        if proc.poll() is not None:
            raise RuntimeError(f"kvsim serve exited with {proc.returncode} before listening")
        if time.monotonic() > deadline:
            raise TimeoutError(f"kvsim serve did not listen within {timeout_s} s (it loads the "
                               "model and compiles the codecs first; raise "
                               "transport.start_timeout_s on a busy machine)")
        time.sleep(0.05)


def _wait_or_stop(serve: subprocess.Popen, timeout_s: float) -> None:
    """The sender is done: the decode host ends by itself once its last request is reported
    (max_requests), or, where some never reached it (refused, a CURVE key it does not allow),
    is stopped after timeout_s, reporting what it has (kvsim serve on SIGTERM)."""
    try:
        serve.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop(serve)


def _rows(report: Path) -> list[dict]:
    if not report.is_file():
        raise RuntimeError(f"the decode host wrote no report ({report})")
    return json.loads(report.read_text())["rows"]


def emulate(cfg: EmulateConfig, host: DecodeHost | None = None) -> list[dict]:
    """Every request of the scenario sent to a decode host: a `kvsim serve` started for this
    run and stopped after it, or `host`, one kept listening over several runs (it must decode
    as this run's would: DecodeHost.admit)."""
    cfg.validate()
    t = cfg.transport
    if t.cpus:  # emulate places both ends itself: a list for one process would be dropped
        raise ValueError(f"transport.cpus={t.cpus!r} pins kvsim serve or kvsim send alone; "
                         "kvsim emulate runs both ends: use transport.split_cpus=true to "
                         "give each its half of the CPUs")
    if host is not None:
        host.admit(cfg)
        return host.rows(host.send(cfg))
    with DecodeHost(cfg, max_requests=_request_count(cfg)) as one:
        sent = one.send(cfg)
        return one.finish(sent)


def _with_device_budget(cfg: EmulateConfig) -> EmulateConfig:
    """cfg, its decode host's device-memory budget set where both ends share a CUDA device
    and none is configured (_shared_device_budget); a device this host lacks is refused
    here, before either end starts."""
    from kvsim.transport import session

    device = session.kv_device(cfg)
    t = cfg.transport
    if device.type != "cuda" or t.max_device_memory_bytes:
        return cfg
    return dataclasses.replace(cfg, transport=dataclasses.replace(
        t, max_device_memory_bytes=_shared_device_budget(cfg, device)))


def _request_count(cfg: EmulateConfig) -> int:
    """Requests the scenario sends: every variant's requests of the workload."""
    import numpy as np

    from kvsim.scenario.variants import variants
    from kvsim.scenario.workload import requests as workload_requests

    return len(variants(cfg)) * len(workload_requests(cfg.workload,
                                                      np.random.default_rng(cfg.seed)))


class DecodeHost:
    """A `kvsim serve`, its CPUs, its address and its link: the decode host of one `kvsim
    emulate` run (max_requests: it ends after them), or of several (max_requests=0: until
    the context ends), each run's sender connecting to it in turn. On loopback (token bucket,
    unshaped) it listens on 127.0.0.1 and the sender sends from this process; with tc it
    listens in the receiver's namespace of a shaped link made when it starts (removed when
    it ends) and the sender sends from a thread of this process inside the sender's
    namespace; each run reshapes the link to its own rate (netns.reshaped) first.

    Kept over several runs it starts once (a new Python process, the model loaded and the
    codecs and the largest request's memory warmed up: ~5-7 s here each time) and decodes
    every run's requests as a decode node of a deployment keeps serving. Its configuration is
    the first run's, with the workload's longest prompt (`warm_context_tokens`) warmed up;
    a run whose decode side would differ is refused (`admit`), and so is keeping one whose
    state would carry from run to run (a prefix store, several decode instances routed by
    their load), and so is a run of the other kind of link (tc or loopback). It starts on
    first use and keeps every run's rows in its own memory (a few per request)."""

    def __init__(self, cfg: EmulateConfig, max_requests: int = 0,
                 warm_context_tokens: int = 0) -> None:
        if cfg.transport.emulation == "tc":
            from kvsim.transport.netns import netns_available

            ok, why = netns_available()
            if not ok:
                raise ValueError(f"transport.emulation=tc needs network namespaces: {why}")
        if max_requests == 0:  # kept over runs: nothing one run leaves may steer the next
            if cfg.prefix_cache.enabled:
                raise ValueError("a decode host kept over runs would hand one run's prefix "
                                 "blocks to the next: prefix_cache.enabled needs a host per run")
            if cfg.workload.decode_nodes > 1:
                raise ValueError("a decode host kept over runs would route each run's requests "
                                 "from where the last run's left its instances: "
                                 "workload.decode_nodes > 1 needs a host per run")
        cfg = _with_device_budget(cfg)
        if warm_context_tokens > cfg.workload.context_tokens:
            cfg = dataclasses.replace(cfg, workload=dataclasses.replace(
                cfg.workload, context_tokens=warm_context_tokens))
        from kvsim.scenario.variants import variants
        from kvsim.transport.session import longest_prompt_tokens

        self.cfg = cfg
        self.max_requests = max_requests
        # what admit() holds each run to, fixed by this configuration
        self._side = _decode_side(cfg)
        self._warmed = {repr(v.spec): v.spec.label for v in variants(cfg)}
        self._longest_tokens = longest_prompt_tokens(cfg)
        self.tx_cpus, self.rx_cpus = _split(cfg)
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._serve: subprocess.Popen | None = None
        self._closed = False
        self._links = contextlib.ExitStack()  # tc: the shaped link, removed at the end
        self._link: NetnsLink | None = None  # tc: the link, shaped for the last run
        self.connect = ""

    def __enter__(self) -> DecodeHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()

    def _close(self) -> None:
        """Stop serve, then remove the link (nothing is left inside its namespaces) and the
        files, each whatever the step before it raised."""
        self._closed = True
        try:
            if self._serve is not None:
                stop(self._serve)
        finally:
            try:
                self._links.close()
            finally:
                if self._tmp is not None:
                    self._tmp.cleanup()
                    self._tmp = None

    def _running(self) -> None:
        """Start `kvsim serve` on first use (a context in which nothing is sent starts
        nothing); RuntimeError once it has exited or the context has ended."""
        if self._serve is None and not self._closed:
            self._start()
        if self._serve is None or self._serve.poll() is not None:
            code = None if self._serve is None else self._serve.returncode
            raise RuntimeError(f"the decode host is not running (exit code {code})")

    def _start(self) -> None:
        t = self.cfg.transport
        self._tmp = tempfile.TemporaryDirectory(prefix="kvsim-emulate-")
        tmp = Path(self._tmp.name)
        self._endpoint_file, self._report = tmp / "endpoint", tmp / "serve-report.json"
        port = t.port or _free_port()
        addr = "127.0.0.1"
        if t.emulation == "tc":
            from kvsim.transport.netns import shaped_link

            self._link = self._links.enter_context(shaped_link(link_spec(self.cfg)))
            addr = self._link.receiver_addr
        rx_cfg = dataclasses.replace(self.cfg, transport=dataclasses.replace(
            t, bind=f"tcp://{addr}:{port}", max_requests=self.max_requests,
            endpoint_file=str(self._endpoint_file), cpus=self.rx_cpus,
            insecure=_insecure(self.cfg)))
        self.connect = f"tcp://{addr}:{port}"
        argv = _child("serve", rx_cfg, tmp, self._report)
        if self._link is not None:
            argv = self._link.argv_in("receiver", argv)
        self._serve = popen(argv, stdout=subprocess.DEVNULL, env=_env(self.rx_cpus))
        _wait_listening(self._serve, self._endpoint_file, t.start_timeout_s)

    def admit(self, cfg: EmulateConfig) -> None:
        """Refuse (ValueError, naming the setting) a run this host would not decode as a
        decode host of the run's own would: another model, device, decode mode, receiver
        setting, decode instances or prefix store, a codec it did not warm up, a prompt
        longer than it warmed up for, the other kind of link (_decode_side); a host that has
        exited (RuntimeError)."""
        budget = cfg.transport.max_device_memory_bytes
        if budget and budget != self.cfg.transport.max_device_memory_bytes:
            raise ValueError(f"transport.max_device_memory_bytes={budget} differs from the "
                             f"decode host kept over runs "
                             f"({self.cfg.transport.max_device_memory_bytes})")
        for key, value in _decode_side(cfg).items():
            if self._side.get(key) != value:
                raise ValueError(f"this run's decode side differs from the decode host kept "
                                 f"over runs in {key}: {value!r} vs {self._side.get(key)!r}")
        from kvsim.scenario.variants import variants
        from kvsim.transport.session import longest_prompt_tokens

        missing = [v.spec.label for v in variants(cfg) if repr(v.spec) not in self._warmed]
        if missing:
            raise ValueError(f"the decode host kept over runs did not warm up codec(s) "
                             f"{missing} (it did {sorted(self._warmed.values())})")
        longest = longest_prompt_tokens(cfg)
        if longest > self._longest_tokens:
            raise ValueError(f"a {longest}-token prompt is longer than the decode host kept "
                             f"over runs warmed up for ({self._longest_tokens})")
        self._running()

    def send(self, cfg: EmulateConfig) -> list[dict]:
        """The run's requests sent to this host (this process pinned to the sender's CPUs
        for the transfer; tc: from the sender's namespace, over the link reshaped to this
        run's rate): the sender's rows, each the decode host's own where it reported the
        request (its DONE carries it)."""
        from kvsim.transport.cpus import parse_cpus, pinned

        self._running()
        t = cfg.transport
        tx_cfg = dataclasses.replace(cfg, transport=dataclasses.replace(
            t, connect=self.connect, insecure=_insecure(cfg)))

        def send() -> list[dict]:
            with pinned(self.tx_cpus):
                # the decode host's metrics on metrics_port, the sender's on the next port;
                # its encoders' kernels as wide as its share (numba's pool is this
                # process's, sized for every CPU)
                return send_all(tx_cfg, t.metrics_port + 1 if t.metrics_port else 0,
                                kernel_threads=len(parse_cpus(self.tx_cpus)))

        if self._link is None:
            return send()
        from kvsim.transport.netns import call_in_netns, reshaped

        try:
            spec = link_spec(cfg)
            if spec != self._link.spec:
                self._link = reshaped(self._link, spec)
            return call_in_netns(self._link.sender_ns, send,
                                 _request_count(cfg) * (t.timeout_s + 300))
        except BaseException:
            # a link left half-shaped, or a sender still running on its thread (timed out,
            # interrupted): no later run may use either, so the host ends here
            self._close()
            raise

    def rows(self, sent: list[dict]) -> list[dict]:
        """A kept host's rows of one run: the sender's, each naming the CPUs of both ends
        where they were split, as kvsim serve's report and emulate name them."""
        if self.rx_cpus:  # rows the decode host reported (not the sender's own: sender_id)
            sent = [r if "sender_id" in r else {**r, "decode_cpus": self.rx_cpus}
                    for r in sent]
        return _with_send_cpus(sent, self.tx_cpus)

    def finish(self, sent: list[dict]) -> list[dict]:
        """A host of one run (max_requests): wait for it to end by itself, then its report's
        rows plus the sender's view of any request it never reported."""
        if self._serve is None:
            raise RuntimeError("the decode host was never started (nothing was sent)")
        _wait_or_stop(self._serve, self.cfg.transport.timeout_s + 10)
        rows = _rows(self._report) if self._report.is_file() else []
        return _with_send_cpus(_merge(rows, sent), self.tx_cpus)


def _insecure(cfg: EmulateConfig) -> bool:
    """Whether both ends go without CURVE keys: as configured on loopback; over tc also
    without keys, since the veth pair joins only the run's two namespaces."""
    t = cfg.transport
    return t.insecure or (t.emulation == "tc" and not t.keys)


def _decode_side(cfg: EmulateConfig) -> dict:
    """What a decode host's configuration decides about how it decodes (kvsim.commands.serve:
    the receiver's settings, decode loops, instances, warm-up), beside the codecs and the
    prompt lengths it warmed up for, which DecodeHost.admit checks apart."""
    from kvsim.transport import session

    t = cfg.transport
    w = cfg.workload
    receive = dataclasses.asdict(session.receiver_settings(cfg, ""))
    # (a device-memory budget is the host's own: set when it started, where none was)
    for key in ("bind", "max_requests", "idle_exit_s", "max_device_memory_bytes"):
        receive.pop(key, None)
    # the link it listens on: loopback (token bucket or unshaped: the sender shapes) or tc's
    # namespaces
    return {"link": "tc" if t.emulation == "tc" else "loopback",
            "model": dataclasses.asdict(cfg.model), "hardware": dataclasses.asdict(cfg.hardware),
            "device": cfg.device, "decode": session.decode_mode(cfg), "threads": t.threads,
            "split_cpus": t.split_cpus, "cpu_wakeup_us": t.cpu_wakeup_us,
            "acceptance": cfg.speculative.acceptance,
            "seed": cfg.seed, "receiver": receive, "prefix_cache":
                dataclasses.asdict(cfg.prefix_cache),
            "instances": (w.decode_nodes, w.decode_max_batch, w.routing)}


def _shared_device_budget(cfg: EmulateConfig, device) -> int:
    """The decode host's device-memory budget for its caches when both ends share one CUDA
    device: half of what the device has free before either starts (less the receiver's
    headroom), after each end's fp32 copy of the model where it loads one (a live prefill,
    real decoding). A decode host alone on its device takes what it finds free instead."""
    from kvsim.transport import session

    free = _device_free_bytes_in_a_child(device)
    models = 0.0
    if cfg.model.params_total:  # the ends load the model in float32
        ends = (session.source_kind(cfg) == "live") + (session.decode_mode(cfg) == "real")
        models = ends * 4 * cfg.model.params_total
    budget = int((free - models) / 2)
    if budget <= 0:
        raise ValueError(f"device={cfg.device}: {free / 2**30:.1f} GiB free there do not hold "
                         f"both ends' fp32 models ({models / 2**30:.1f} GiB) and any cache; "
                         "set transport.max_device_memory_bytes to override")
    return budget


def _device_free_bytes_in_a_child(device) -> int:
    """kvsim.transport.receiver.device_free_bytes, read by a short-lived child: this process
    opens no CUDA context of its own for it before its sender does (a context held here
    would take device memory, or the device itself in exclusive-process mode)."""
    code = ("import sys; from kvsim.transport.receiver import device_free_bytes; "
            "print(device_free_bytes(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", code, str(device)], capture_output=True,
                          text=True, timeout=120, env=_env())
    if proc.returncode != 0:
        raise RuntimeError(f"reading {device}'s free memory failed: {proc.stderr[-500:]}")
    return int(proc.stdout.strip().splitlines()[-1])


def _with_send_cpus(rows: list[dict], cpus: str) -> list[dict]:
    """Every row names the sender's CPUs where it was pinned (transport.split_cpus)."""
    return [{**r, "send_cpus": cpus} for r in rows] if cpus else rows


def link_spec(cfg: EmulateConfig) -> NetemSpec:
    """The tc link a run's transport asks for (kvsim.transport.netns.NetemSpec): its rate,
    delay, jitter and loss, on a k-times slower link with k-times longer delays
    (transport.time_scale; rows divide by k)."""
    from kvsim.transport.netns import NetemSpec

    t = cfg.transport
    k = t.time_scale
    return NetemSpec(cfg.link.bandwidth_gbps / k, t.delay_ms * k, t.jitter_ms * k, t.loss_pct)


def _merge(rx_rows: list[dict], tx_rows: list[dict]) -> list[dict]:
    """The decode host's rows, plus the sender's view of any request it never reported."""
    have = {r.get("request_id") for r in rx_rows}
    return rx_rows + [r for r in tx_rows if r.get("request_id") not in have]


def _env(cpus: str = "") -> dict:
    """A child's environment: offline model hubs; pinned to `cpus`, numba's pool as large
    as its share (read when numba is imported, before the pin)."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    if cpus:
        from kvsim.transport.cpus import parse_cpus

        env["NUMBA_NUM_THREADS"] = str(len(parse_cpus(cpus)))
    return env


def _split(cfg: EmulateConfig) -> tuple[str, str]:
    """(the sender's CPUs, the decode host's) as transport.cpus lists; ("", "") unless
    transport.split_cpus."""
    if not cfg.transport.split_cpus:
        return "", ""
    from kvsim.transport.cpus import format_cpus, halves

    tx, rx = halves()
    return format_cpus(tx), format_cpus(rx)
