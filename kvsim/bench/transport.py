"""Transport benchmark: real chunks through the real transport, each figure set against a
baseline measured in the same run (raw ZeroMQ, the configured rate, the ideal anchor time).

Every measurement runs three processes, so sender and receiver each own their CPU and
their process CPU time (`time.process_time`, all threads incl. ZeroMQ's I/O thread) is
theirs alone:

    receivers: `python -m kvsim.bench.transport rx-transport JOB OUT`  (kvsim Receiver)
               `python -m kvsim.bench.transport rx-raw JOB OUT`        (bare ROUTER)
    sender:    `python -m kvsim.bench.transport tx JOB OUT`            (runs every case)

On loopback they are plain children; for `tc` each runs inside its side's network namespace
(`NetnsLink.argv_in`). One session (one set of processes) runs many cases in sequence.

A case moves real codec chunks: `distinct_layers` layers of synthetic KV (kvsim.kv.synthetic)
are generated and encoded before anything is timed; a cache of `layers` layers repeats them
(layer l sends the chunks of layer l % distinct_layers), so a multi-GB transfer costs neither
memory nor encoding time. encode='pre' hands the sender those encodings (the figure is the
transport's alone: framing, CRC32C, credit window, ACKs, scheduler, link loop); 'live' runs the
codec in the sender's encoder thread as `kvsim send` does.

Times (Unix s, one clock: every process runs on this machine):
  first_send_t   sender: the transport's own (FIN): when the link first holds the request's
                 bytes (before the token bucket makes the first chunk wait); raw ZeroMQ:
                 just before the first message is handed to ZeroMQ
  last_arrival_t receiver, after the last data message was received (and, for the transport,
                 parsed, checksummed and assembled)
  goodput = wire bytes / (last_arrival_t - first_send_t); wire bytes = every data message's
  bytes (transport: 24-byte control frame + 20-byte chunk header + payload; raw ZeroMQ:
  messages of exactly those sizes).
Through the token bucket (a serializing link: each chunk leaves when its last byte would
have crossed it, starting when the link is free) chunk k >= 2 leaves exactly n_k / rate
after chunk k-1 on a backlogged link. Token-bucket goodput counts from the first chunk's
actual send and leaves that chunk's bytes out: (wire bytes - n_1) / (last_arrival_t - first
chunk sent), which is the rate exactly when the sender is on time, whatever the start.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvsim.transport.children import popen, stop

# transport control frame (24) + chunk header (20) per chunk message; a literal, not
# protocol's constants: importing protocol pulls in torch, and the bare-ROUTER child
# (rx-raw) stays light (tests/test_bench_transport.py checks the sum)
FRAME_OVERHEAD_BYTES = 44
START_TIMEOUT_S = 120.0  # a receiver process imports torch before it listens
ROLES = ("rx-transport", "rx-raw", "tx")


@dataclass
class CaseSpec:
    """One measurement the sender process runs (JSON between processes)."""

    name: str  # unique within a session
    kind: str  # transport | raw
    codec: str = "bf16"  # codec preset (conf/codec)
    policy: str = "monolithic"  # transfer policy
    kv_heads: int = 8
    head_dim: int = 128
    tokens: int = 4096
    layers: int = 1  # layers of the cache sent
    distinct_layers: int = 2  # generated + encoded layers; the others repeat them
    encode: str = "pre"  # pre | live
    rate_gbps: float = 0.0  # token bucket rate; 0: unlimited
    burst_bytes: int = 0  # token bucket lead (bytes a chunk may leave early; 0: none)
    link_gbps: float = 0.0  # rate of a tc-shaped link below (only sets timeouts); 0: none
    seed: int = 0


# ---- sizes (from the codec's size table: nothing is encoded) -----------------------------
def layer_wire_bytes(codec: str, kv_heads: int, head_dim: int, tokens: int) -> list[int]:
    """Per stream, the wire bytes one layer puts on the link (payloads + 44-byte frames)."""
    from kvsim.core.layout import KVShape
    from kvsim.kernels import wire
    from kvsim.kernels.presets import resolve_codec

    table = resolve_codec(codec).build().size_table(KVShape(1, kv_heads, tokens, head_dim))
    out = []
    for s in range(table.chunk_bytes.shape[0]):
        sizes = table.chunk_bytes[s][table.chunk_bytes[s] > 0]
        out.append(int(sizes.sum()) + len(sizes) * (FRAME_OVERHEAD_BYTES -
                                                     wire.CHUNK_HEADER_BYTES))
    return out


def layers_for(target_bytes: float, per_layer_bytes: int) -> int:
    return max(1, round(target_bytes / per_layer_bytes))


# ---- orchestration (main process) --------------------------------------------------------
Wrap = Callable[[str, list[str]], list[str]]  # (side, argv) -> argv run on that side


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _argv(role: str, job: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "kvsim.bench.transport", role, str(job), str(out)]


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text()[-chars:]
    except OSError:
        return ""


def _wait_endpoint(proc: subprocess.Popen, path: Path, log: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        if proc.poll() is not None:
            raise RuntimeError(f"a receiver exited with {proc.returncode} before listening:\n"
                               f"{_tail(log)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"a receiver did not listen within {START_TIMEOUT_S} s")
        time.sleep(0.05)


def run_session(cases: list[CaseSpec], *, bind_host: str = "127.0.0.1",
                wrap: Wrap | None = None, window_bytes: int, max_queued_bytes: int,
                timeout_s: float, session_timeout_s: float,
                keys: str = "") -> dict[str, dict]:
    """Start the receivers and the sender (each through `wrap`), run `cases` in order and
    return each case's result by name (a failed case: status != 'done' and an error).
    keys: a `kvsim keys` directory: every socket, raw and transport, uses CURVE."""
    wrap = wrap or (lambda side, argv: argv)
    kinds = {c.kind for c in cases}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="kvsim-bench-transport-") as tmp_name:
        tmp = Path(tmp_name)
        try:
            endpoints = {}
            for kind in ("transport", "raw"):
                if kind not in kinds:
                    continue
                role = f"rx-{kind}"
                job = tmp / f"{role}.json"
                job.write_text(json.dumps({
                    "bind": f"tcp://{bind_host}:*", "endpoint_file": str(tmp / f"{role}.ep"),
                    "timeout_s": timeout_s, "window_bytes": window_bytes, "keys": keys}))
                log = tmp / f"{role}.log"
                with open(log, "w") as err:
                    procs.append(popen(
                        wrap("receiver", _argv(role, job, tmp / f"{role}.out")),
                        stdout=subprocess.DEVNULL, stderr=err, env=_env()))
                endpoints[kind] = _wait_endpoint(procs[-1], tmp / f"{role}.ep", log)
            job = tmp / "tx.json"
            job.write_text(json.dumps({
                "cases": [asdict(c) for c in cases], "endpoints": endpoints,
                "timeout_s": timeout_s, "max_queued_bytes": max_queued_bytes, "keys": keys}))
            out, log = tmp / "tx.out", tmp / "tx.log"
            with open(log, "w") as err:
                tx = popen(wrap("sender", _argv("tx", job, out)),
                           stdout=subprocess.DEVNULL, stderr=err, env=_env())
            procs.append(tx)
            try:
                tx.wait(timeout=session_timeout_s)
            except subprocess.TimeoutExpired:
                pass  # the cases done so far are in `out`
            results = {r["name"]: r for r in json.loads(out.read_text())} \
                if out.is_file() else {}
            for c in cases:
                results.setdefault(c.name, {
                    "name": c.name, "status": "error",
                    "error": f"sender exited with {tx.returncode} before this case: "
                             f"{_tail(log, 600)}"})
            return results
        finally:
            for p in reversed(procs):
                stop(p)


# ---- figures from results (main process) -------------------------------------------------
def figures(result: dict, exclude_first_chunk: bool = False) -> dict:
    """Goodput and CPU of one finished case. Keys: link_bytes, chunks, wire_s,
    goodput_gb_per_s, goodput_gbps, tx_cpu_s_per_gb, rx_cpu_s_per_gb (+ transport: the
    per-stream arrivals and the goodput counting every chunk, goodput_all_gbps)."""
    if result.get("status") != "done":
        raise RuntimeError(f"case {result.get('name')}: {result.get('status')}: "
                           f"{result.get('error')}")
    if result["kind"] == "raw":
        link_bytes, chunks = result["rx_bytes"], result["chunks"]
        first_send, last = result["first_send_t"], result["last_arrival_t"]
        first_bytes = result["first_chunk_bytes"]
        first_chunk_sent = first_send
        rx_cpu = result["rx_cpu_s"]
        extra: dict[str, Any] = {}
    else:
        row = result["row"]
        streams = row["streams"]
        link_bytes = sum(s["link_bytes"] for s in streams)
        chunks = sum(s["chunks"] for s in streams)
        first_send = row["fin"]["first_send_t"]
        last = max(s["last_arrival_t"] for s in streams)
        first_bytes = result["first_chunk_bytes"]
        first_chunk_sent = result["first_chunk_send_t"]
        rx_cpu = row["rx_cpu_s"]
        send_s = result["last_send_t"] - first_chunk_sent  # chunks 2..N handed to ZeroMQ
        extra = {"streams": streams, "first_send_t": first_send,
                 "encode_s": result.get("encode_s", math.nan),
                 "send_gbps": 8 * (link_bytes - first_bytes) / send_s / 1e9
                 if send_s > 0 else math.nan,
                 "resent_chunks": result.get("resent_chunks", 0),
                 "rx_page_faults_per_mb": row.get("rx_page_faults", 0) / (link_bytes / 1e6),
                 "refused_frames": row.get("refused_frames") or {}}
    wire_s = last - first_send
    if exclude_first_chunk:  # pay before send: see the module doc
        counted, timed_s = link_bytes - first_bytes, last - first_chunk_sent
    else:
        counted, timed_s = link_bytes, wire_s
    gb = link_bytes / 1e9
    out = {"link_bytes": link_bytes, "chunks": chunks,
           "chunk_bytes": link_bytes / chunks if chunks else math.nan, "wire_s": wire_s,
           "goodput_gb_per_s": counted / timed_s / 1e9 if timed_s > 0 else math.nan,
           "goodput_all_gbps": 8 * link_bytes / wire_s / 1e9 if wire_s > 0 else math.nan,
           "tx_cpu_s_per_gb": result["tx_cpu_s"] / gb, "rx_cpu_s_per_gb": rx_cpu / gb,
           "tx_cpu_s": result["tx_cpu_s"], "rx_cpu_s": rx_cpu, **extra}
    out["goodput_gbps"] = 8 * out["goodput_gb_per_s"]
    return out


def best_of(results: list[dict]) -> dict:
    """Highest-goodput repeat, with the median goodput and median CPU figures over all."""
    figs = [figures(r) for r in results]
    best = dict(max(figs, key=lambda f: f["goodput_gb_per_s"]))
    best["goodput_median_gb_per_s"] = statistics.median(f["goodput_gb_per_s"] for f in figs)
    for key in ("tx_cpu_s_per_gb", "rx_cpu_s_per_gb"):
        best[key] = statistics.median(f[key] for f in figs)
    best["repeats"] = len(figs)
    return best


def anchor_figures(result: dict, rate_gbps: float) -> dict:
    """Stream 0 (anchor) complete, from the first send, vs anchor wire bytes * 8 / rate."""
    f = figures(result)
    anchor = f["streams"][0]
    measured = anchor["complete_t"] - f["first_send_t"]
    ideal = 8 * anchor["link_bytes"] / (rate_gbps * 1e9)
    return {**f, "anchor_bytes": anchor["link_bytes"], "anchor_chunks": anchor["chunks"],
            "anchor_s": measured, "ideal_s": ideal, "ratio": measured / ideal,
            "all_streams_s": max(s["complete_t"] for s in f["streams"]) - f["first_send_t"]}


# ---- the benchmark (main process) --------------------------------------------------------
def _row(part: str, case: str, **fields: Any) -> dict:
    return {"part": part, "case": case, "status": "done", **fields}


def _failed(part: str, case: str, status: str, reason: str, **fields: Any) -> dict:
    return {"part": part, "case": case, "status": status, "reason": reason, **fields}


def _common(f: dict) -> dict:
    keep = ("link_bytes", "chunks", "chunk_bytes", "wire_s", "goodput_gb_per_s", "goodput_gbps",
            "goodput_all_gbps", "goodput_median_gb_per_s", "send_gbps", "repeats",
            "tx_cpu_s_per_gb", "rx_cpu_s_per_gb", "rx_page_faults_per_mb", "resent_chunks",
            "refused_frames")
    return {"mb": f["link_bytes"] / 1e6, **{k: f[k] for k in keep if k in f}}


def _session_kw(cfg: Any) -> dict:
    return {"window_bytes": cfg.window_bytes, "max_queued_bytes": cfg.max_queued_bytes,
            "timeout_s": cfg.timeout_s, "session_timeout_s": cfg.session_timeout_s}


def _warmup(base: dict, layers: int = 0) -> list[CaseSpec]:
    """One tiny raw and transport transfer first (connections, imports, codec registry);
    with `layers`, also a transport transfer of that size: a fresh receiver page-faults
    in the memory of the largest request it has held (~0.6 s/GB of receiver CPU, once),
    which a long-running decode node has already paid."""
    tiny = {**base, "tokens": 256, "distinct_layers": 1, "layers": 2}
    cases = [CaseSpec("warmup/raw", "raw", **tiny),
             CaseSpec("warmup/transport", "transport", **tiny)]
    if layers:
        cases.append(CaseSpec("warmup/transport-full", "transport", **{**base, "layers": layers}))
    return cases


def run_bench(cfg: Any) -> list[dict]:
    """Every part of `kvsim bench transport` (cfg: kvsim.commands.bench_transport.Config)."""
    shape = cfg.shape
    base = {"codec": cfg.codec, "policy": cfg.policy, "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim, "tokens": shape.tokens,
            "distinct_layers": cfg.distinct_layers, "seed": cfg.seed}
    per_layer = sum(layer_wire_bytes(cfg.codec, shape.kv_heads, shape.head_dim, shape.tokens))
    cases: list[CaseSpec] = []
    warm_layers = 0
    if "loopback" in cfg.parts:
        layers = warm_layers = layers_for(cfg.loopback.mb * 1e6, per_layer)
        for i in range(cfg.loopback.repeats):
            cases += [CaseSpec(f"loopback/raw/{i}", "raw", layers=layers, **base),
                      CaseSpec(f"loopback/transport/{i}", "transport", layers=layers, **base)]
    if "token_bucket" in cfg.parts:
        tb = cfg.token_bucket
        for rate in tb.rates_gbps:
            cases.append(CaseSpec(f"token_bucket/{rate:g}", "transport",
                                  layers=layers_for(rate * 1e9 / 8 * tb.seconds, per_layer),
                                  rate_gbps=rate, burst_bytes=tb.burst_bytes, **base))
    if "anchor" in cfg.parts:
        a = cfg.anchor
        anchor_layer = layer_wire_bytes(a.codec, shape.kv_heads, shape.head_dim,
                                        shape.tokens)[0]
        layers = layers_for(a.rate_gbps * 1e9 / 8 * a.anchor_seconds, anchor_layer)
        for encode in a.encode:
            cases.append(CaseSpec(f"anchor/{encode}", "transport",
                                  **{**base, "codec": a.codec, "policy": a.policy},
                                  layers=layers, encode=encode, rate_gbps=a.rate_gbps,
                                  burst_bytes=a.burst_bytes))
    results = run_session(_warmup(base, warm_layers) + cases, **_session_kw(cfg)) \
        if cases else {}
    rows: list[dict] = []
    if "loopback" in cfg.parts:
        rows += _loopback_rows(cfg, results)
    if "curve" in cfg.parts:
        rows += _curve_rows(cfg, base, per_layer, rows)
    if "token_bucket" in cfg.parts:
        for rate in cfg.token_bucket.rates_gbps:
            rows.append(_rate_row("token_bucket", "transport", rate,
                                  results[f"token_bucket/{rate:g}"], cfg, True))
    if "tc" in cfg.parts:
        rows += _tc_rows(cfg, base, per_layer)
    if "anchor" in cfg.parts:
        for encode in cfg.anchor.encode:
            rows.append(_anchor_row(cfg, encode, results[f"anchor/{encode}"]))
    return rows


def _loopback_rows(cfg: Any, results: dict, part: str = "loopback",
                   repeats: int | None = None, min_gb_per_s: float | None = None
                   ) -> list[dict]:
    """Raw ZeroMQ and the transport, best of `repeats` each, the transport as a ratio of raw
    (target: loopback_vs_raw, and at least min_gb_per_s GB/s)."""
    t = cfg.targets
    repeats = cfg.loopback.repeats if repeats is None else repeats
    floor = t.loopback_gb_per_s if min_gb_per_s is None else min_gb_per_s
    got = {}
    for kind in ("raw", "transport"):
        runs = [results[f"{part}/{kind}/{i}"] for i in range(repeats)]
        bad = [r for r in runs if r.get("status") != "done"]
        got[kind] = (None, bad[0]) if bad else (best_of(runs), None)
    rows = []
    raw, raw_bad = got["raw"]
    if raw is None:
        rows.append(_failed(part, "raw_zmq", raw_bad["status"], raw_bad.get("error", "")))
    else:
        rows.append(_row(part, "raw_zmq", rate_gbps=None, **_common(raw)))
    tr, tr_bad = got["transport"]
    target = f">={floor:g} GB/s & >={t.loopback_vs_raw:g}x" if floor else \
        f">={t.loopback_vs_raw:g}x"
    if tr is None:
        rows.append(_failed(part, "transport", tr_bad["status"], tr_bad.get("error", ""),
                            target=target, met=False))
        return rows
    ratio = tr["goodput_gb_per_s"] / raw["goodput_gb_per_s"] if raw else math.nan
    met = tr["goodput_gb_per_s"] >= floor and ratio >= t.loopback_vs_raw
    rows.append(_row(part, "transport", rate_gbps=None, **_common(tr),
                     baseline="raw_zmq", ratio=ratio, target=target, met=bool(met)))
    return rows


def _curve_rows(cfg: Any, base: dict, per_layer: int, rows_so_far: list[dict]) -> list[dict]:
    """The loopback comparison with CURVE on every socket (keys made for the run), in its
    own processes; the raw row also says CURVE's cost: its goodput / the plain raw one's
    (this run's loopback part), and CPU s/GB beside it."""
    from kvsim.transport.auth import write_keys

    layers = layers_for(cfg.curve.mb * 1e6, per_layer)
    cases = []
    for i in range(cfg.curve.repeats):
        cases += [CaseSpec(f"curve/raw/{i}", "raw", layers=layers, **base),
                  CaseSpec(f"curve/transport/{i}", "transport", layers=layers, **base)]
    with tempfile.TemporaryDirectory(prefix="kvsim-bench-keys-") as keys:
        write_keys(Path(keys) / "keys")
        results = run_session(_warmup(base, layers) + cases, keys=str(Path(keys) / "keys"),
                              **_session_kw(cfg))
    rows = _loopback_rows(cfg, results, "curve", cfg.curve.repeats, min_gb_per_s=0.0)
    plain = next((r for r in rows_so_far if r["part"] == "loopback" and
                  r["case"] == "raw_zmq" and r["status"] == "done"), None)
    for r in rows:
        r["curve"] = True
        if r["case"] == "raw_zmq" and r["status"] == "done" and plain is not None:
            r["vs_plain_raw_zmq"] = r["goodput_gb_per_s"] / plain["goodput_gb_per_s"]
    return rows


def _rate_row(part: str, case: str, rate: float, result: dict, cfg: Any,
              exclude_first: bool, target: bool = True, **extra: Any) -> dict:
    want = f">={cfg.targets.rate_fraction:g}x" if target else None
    if result.get("status") != "done":
        return _failed(part, case, result.get("status", "error"), result.get("error", ""),
                       rate_gbps=rate, target=want, met=False if target else None)
    f = figures(result, exclude_first_chunk=exclude_first)
    ratio = f["goodput_gbps"] / rate
    return _row(part, case, rate_gbps=rate, **_common(f), baseline="rate", ratio=ratio,
                target=want, met=bool(ratio >= cfg.targets.rate_fraction) if target else None,
                **extra)


def _tc_rows(cfg: Any, base: dict, per_layer: int) -> list[dict]:
    from kvsim.transport.netns import NetemSpec, netns_available, shaped_link

    ok, why = netns_available()
    if not ok:
        return [_failed("tc", case, "skipped", why, rate_gbps=rate)
                for rate in cfg.tc.rates_gbps for case in ("raw_zmq", "transport")]
    rows = []
    for rate in cfg.tc.rates_gbps:
        layers = layers_for(rate * 1e9 / 8 * cfg.tc.seconds, per_layer)
        cases = [CaseSpec("tc/raw", "raw", layers=layers, link_gbps=rate, **base),
                 CaseSpec("tc/transport", "transport", layers=layers, link_gbps=rate, **base)]
        try:
            with shaped_link(NetemSpec(rate)) as link:
                res = run_session(_warmup(base) + cases, bind_host=link.receiver_addr,
                                  wrap=link.argv_in, **_session_kw(cfg))
        except Exception as exc:  # a link that cannot be built: say so, run the rest
            rows += [_failed("tc", case, "error", f"{type(exc).__name__}: {exc}",
                             rate_gbps=rate) for case in ("raw_zmq", "transport")]
            continue
        raw = _rate_row("tc", "raw_zmq", rate, res["tc/raw"], cfg, False, target=False)
        tr = _rate_row("tc", "transport", rate, res["tc/transport"], cfg, False)
        if raw["status"] == "done" and tr["status"] == "done":
            tr["vs_raw_zmq"] = tr["goodput_gbps"] / raw["goodput_gbps"]
        rows += [raw, tr]
    return rows


def _anchor_row(cfg: Any, encode: str, result: dict) -> dict:
    a, tol = cfg.anchor, cfg.targets.anchor_tolerance
    target = f"1+-{tol:g}"
    case = f"{a.codec} {a.policy} encode={encode}"
    if result.get("status") != "done":
        return _failed("anchor", case, result.get("status", "error"), result.get("error", ""),
                       rate_gbps=a.rate_gbps, target=target, met=False)
    f = anchor_figures(result, a.rate_gbps)
    return _row("anchor", case, rate_gbps=a.rate_gbps, encode=encode, **_common(f),
                anchor_mb=f["anchor_bytes"] / 1e6, anchor_chunks=f["anchor_chunks"],
                anchor_s=f["anchor_s"], ideal_s=f["ideal_s"], ratio=f["ratio"],
                all_streams_s=f["all_streams_s"], encode_s=f["encode_s"],
                encode_per_layer_s=f["encode_s"] / result["layers"],
                anchor_link_per_layer_s=f["ideal_s"] / result["layers"], baseline="ideal",
                target=target,
                met=bool(abs(f["ratio"] - 1) <= tol))


# ---- child processes ---------------------------------------------------------------------
def _write_json(path: str, doc: Any) -> None:
    tmp = Path(path).with_suffix(".part")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


def _minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _rx_transport(job: dict, out: str) -> None:
    """kvsim's Receiver with a decode loop that only waits for every stream; each report
    row carries the per-stream arrival times and the CPU the request cost this process."""
    import torch

    from kvsim.kernels import wire
    from kvsim.transport import protocol as P
    from kvsim.transport.receiver import Receiver, ReceiverSettings

    torch.set_num_threads(1)
    wait_s = float(job["timeout_s"])
    cpu0: dict[int, float] = {}

    class WaitAll:
        def run(self, view, speculative, output_tokens, cap_tokens, timeout_s):
            if not view.wait_streams(view.num_streams, wait_s):
                raise TimeoutError(f"streams incomplete after {wait_s} s")
            return True

    def make_decoder(hello: dict, asm):
        cpu0[asm.request_id] = (time.process_time(), _minor_faults())
        return WaitAll(), {}

    def build_row(asm, hello: dict, result, error: str) -> dict:
        t0, faults0 = cpu0.pop(asm.request_id, (math.nan, 0))
        cpu, faults = time.process_time() - t0, _minor_faults() - faults0
        per_chunk = P.CONTROL_BYTES + P.CHUNK_HEADER_BYTES - wire.CHUNK_HEADER_BYTES
        return {"request_id": asm.request_id, "case": hello.get("bench_case"),
                "status": "done" if result is not None and not error else "error",
                "error": error, "rx_cpu_s": cpu, "rx_page_faults": faults, "fin": asm.fin or {},
                "refused_frames": dict(asm.refused),
                "streams": [{"name": name, "chunks": st.count,
                             "link_bytes": st.bytes + st.count * per_chunk,
                             "first_arrival_t": st.first_arrival_t,
                             "last_arrival_t": st.last_arrival_t,
                             "complete_t": st.complete_t}
                            for name, st in zip(asm.codec.stream_names(), asm.streams,
                                                strict=True)]}

    settings = ReceiverSettings(bind=job["bind"], model="", timeout_s=wait_s, heartbeat_s=0.5,
                                window_bytes=int(job["window_bytes"]), max_request_bytes=1 << 40,
                                max_requests=0, idle_exit_s=0.0,
                                dequantize="on_demand",  # the transport alone: nothing decoded
                                # its own loopback or namespaces' veth pair: nothing else
                                # reaches it
                                insecure=True, keys=job.get("keys", ""))
    rx = Receiver(settings, make_decoder, build_row,
                  log=lambda msg: print(f"rx-transport: {msg}", file=sys.stderr))
    signal.signal(signal.SIGTERM, lambda *_: rx.stop.set())

    def announce() -> None:
        rx.bound.wait()
        if rx.endpoint:
            Path(job["endpoint_file"]).write_text(rx.endpoint + "\n")

    threading.Thread(target=announce, daemon=True).start()
    rows = rx.serve()
    _write_json(out, {"rows": rows, "refused": dict(rx.refused)})


def _rx_raw(job: dict, out: str) -> None:
    """Bare ZeroMQ ROUTER: per case, a 'start' (count) -> 'ready'; then `count` single-frame
    messages, received zero-copy and dropped; then 'done' with the arrival times and CPU."""
    import zmq

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.RCVHWM, 64)  # as the transport's ROUTER (receiver.RCVHWM_MESSAGES)
    authenticator = None
    if job.get("keys"):
        from kvsim.transport.auth import secure_server

        authenticator = secure_server(ctx, sock, job["keys"], True, job["bind"])
    sock.bind(job["bind"])
    Path(job["endpoint_file"]).write_text(sock.getsockopt(zmq.LAST_ENDPOINT).decode() + "\n")
    count = got = nbytes = 0
    first = last = cpu0 = 0.0
    cases = 0
    while not stop.is_set():
        if not sock.poll(200, zmq.POLLIN):
            continue
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2 and got < count:  # [peer, data]
            t = time.time()
            if got == 0:
                first = t
            last = t
            got += 1
            nbytes += len(frames[1])
            if got == count:
                doc = {"first_arrival_t": first, "last_arrival_t": last, "bytes": nbytes,
                       "count": got, "cpu_s": time.process_time() - cpu0}
                sock.send_multipart([frames[0].bytes, b"done", json.dumps(doc).encode()])
                cases += 1
            continue
        if len(frames) != 3:
            continue
        peer, what = frames[0].bytes, frames[1].bytes
        if what == b"quit":
            break
        if what == b"start":
            count = int(json.loads(frames[2].bytes)["count"])
            got = nbytes = 0
            cpu0 = time.process_time()
            sock.send_multipart([peer, b"ready", b""])
    sock.close()
    if authenticator is not None:
        authenticator.stop()
    ctx.term()
    _write_json(out, {"cases": cases})


class _PreEncoded:
    """A codec whose encode(layer index) returns encodings made before the run (layer l:
    those of layer l % len(encodings)); everything else is the real codec's."""

    def __init__(self, codec: Any, encodings: list) -> None:
        self._codec, self._encodings = codec, encodings

    def __getattr__(self, name: str) -> Any:
        return getattr(self._codec, name)

    def encode(self, layer: int) -> Any:
        return self._encodings[layer % len(self._encodings)]


_PAYLOADS: dict[tuple, tuple] = {}


def _payloads(c: CaseSpec) -> tuple[Any, list, list]:
    """(codec, [1-layer KV], [their encodings]) for the case's codec and shape (cached)."""
    key = (c.codec, c.kv_heads, c.head_dim, c.tokens, c.distinct_layers, c.seed)
    if key not in _PAYLOADS:
        from kvsim.core.layout import KVShape
        from kvsim.kernels.presets import resolve_codec
        from kvsim.kv.synthetic import generate_layer

        codec = resolve_codec(c.codec).build()
        base = KVShape(c.distinct_layers, c.kv_heads, c.tokens, c.head_dim)
        kvs = [generate_layer(base, i, seed=c.seed)[None]  # [1, 2, heads, tokens, dim]
               for i in range(c.distinct_layers)]
        _PAYLOADS[key] = (codec, kvs, [codec.encode(kv) for kv in kvs])
    return _PAYLOADS[key]


def _chunk_sizes(c: CaseSpec) -> dict[tuple[int, int], int]:
    """(stream, page) -> wire bytes of that chunk message (every layer alike)."""
    _, _, encs = _payloads(c)
    return {(ch.stream, ch.page): FRAME_OVERHEAD_BYTES + int(ch.payload.nbytes)
            for stream in encs[0].streams for ch in stream}


def _expect(sock: Any, what: bytes, timeout_s: float) -> bytes:
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError(f"no {what.decode()!r} from the raw receiver within {timeout_s} s")
    frames = sock.recv_multipart()
    if frames[0] != what:
        raise RuntimeError(f"raw receiver said {frames[0]!r}, expected {what!r}")
    return frames[1]


def _tx_raw(sock: Any, c: CaseSpec, timeout_s: float) -> dict:
    """The case's messages (same count, same sizes, the chunks' bytes) as single frames,
    zero-copy, no framing, no checksum, no acknowledgement."""
    import numpy as np

    _, _, encs = _payloads(c)
    buffers = []  # per distinct layer: [stream-major chunks] as header-sized + payload
    for enc in encs:
        layer = []
        for stream in enc.streams:
            for ch in stream:
                buf = np.zeros(FRAME_OVERHEAD_BYTES + ch.payload.nbytes, dtype=np.uint8)
                buf[FRAME_OVERHEAD_BYTES:] = ch.payload
                layer.append(buf)
        buffers.append(layer)
    order = [buf for i in range(c.layers) for buf in buffers[i % len(buffers)]]
    total = sum(b.nbytes for b in order)
    sock.send_multipart([b"start", json.dumps({"count": len(order)}).encode()])
    _expect(sock, b"ready", timeout_s)
    cpu0 = time.process_time()
    t0 = time.time()
    for buf in order:
        sock.send(buf, copy=False)
    slowest_gbps = min(g for g in (c.link_gbps, c.rate_gbps, 1.0) if g > 0)
    doc = json.loads(_expect(sock, b"done", timeout_s + 8 * total / (slowest_gbps * 1e9)))
    return {"kind": "raw", "status": "done", "chunks": len(order), "link_bytes": total,
            "rx_bytes": doc["bytes"], "first_send_t": t0,
            "first_arrival_t": doc["first_arrival_t"], "last_arrival_t": doc["last_arrival_t"],
            "first_chunk_bytes": int(order[0].nbytes), "tx_cpu_s": time.process_time() - cpu0,
            "rx_cpu_s": doc["cpu_s"], "wall_s": time.time() - t0}


def _tx_transport(c: CaseSpec, endpoint: str, timeout_s: float, max_queued: int,
                  keys: str = "") -> dict:
    from kvsim.core.layout import KVShape
    from kvsim.transport.rate_limiter import TokenBucket, Unlimited
    from kvsim.transport.sender import OutgoingRequest, Sender
    from kvsim.transport.source import KVSource

    codec, kvs, encs = _payloads(c)
    shape = KVShape(c.layers, c.kv_heads, c.tokens, c.head_dim)
    if c.encode == "pre":
        send_codec: Any = _PreEncoded(codec, encs)

        def make_layer(i: int) -> int:
            return i  # the pre-encoded codec's encode() takes the layer index
    else:
        send_codec = codec

        def make_layer(i: int) -> Any:
            return kvs[i % len(kvs)]
    source = KVSource(shape, "synthetic", 0.0, False, None,
                      {"kv_source": "synthetic", "bench": c.name}, _make_layer=make_layer)
    limiter = TokenBucket(c.rate_gbps, c.burst_bytes) if c.rate_gbps > 0 \
        else Unlimited()
    sender = Sender(endpoint, limiter, "anchors_first", timeout_s, 0.5, max_queued,
                    log=lambda msg: print(f"tx: {msg}", file=sys.stderr), insecure=True,
                    keys=keys)
    request = OutgoingRequest(secrets.randbits(128), 0, 0.0, send_codec, c.codec, c.policy,
                              lambda: source, {"output_tokens": 1, "bench_case": c.name})
    cpu0 = time.process_time()
    t0 = time.time()
    (res,) = sender.run([request])
    cpu = time.process_time() - cpu0
    sizes = _chunk_sizes(c)
    sends = res.sends  # (stream, layer, page, send time)
    first_bytes = 0
    if sends:
        s, _, p, _ = sends[0]
        first_bytes = sizes[(s, p)]
    status = res.status if res.row is None or res.row.get("status") == "done" else "error"
    return {"kind": "transport", "status": status,
            "error": res.error or (res.row or {}).get("error", ""), "row": res.row,
            "sent_bytes": res.sent_bytes, "resent_chunks": res.resent_chunks,
            "first_chunk_bytes": first_bytes, "tx_cpu_s": cpu, "wall_s": time.time() - t0,
            "first_chunk_send_t": sends[0][3] if sends else math.nan,
            "last_send_t": sends[-1][3] if sends else math.nan,
            "encode_s": sum(e[2] - e[1] for e in res.events if e[0].startswith("encode")),
            "protocol_errors": sender.protocol_errors}


def _tx(job: dict, out: str) -> None:
    import torch
    import zmq

    torch.set_num_threads(1)
    timeout_s = float(job["timeout_s"])
    raw = None
    ctx = zmq.Context()
    if "raw" in job["endpoints"]:
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 1000)
        raw.setsockopt(zmq.SNDHWM, 0)  # as the transport's DEALER
        if job.get("keys"):
            from kvsim.transport.auth import secure_client

            secure_client(raw, job["keys"], True, job["endpoints"]["raw"])
        raw.connect(job["endpoints"]["raw"])
    results = []
    for doc in job["cases"]:
        c = CaseSpec(**doc)
        try:
            if c.kind == "raw":
                r = _tx_raw(raw, c, timeout_s)
            else:
                r = _tx_transport(c, job["endpoints"]["transport"], timeout_s,
                                  int(job["max_queued_bytes"]), job.get("keys", ""))
        except Exception as exc:  # the case fails, the session goes on
            r = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        r["name"], r["layers"] = c.name, c.layers
        results.append(r)
        _write_json(out, results)  # after each case: a timeout keeps what was measured
    if raw is not None:
        raw.send_multipart([b"quit", b""])
        raw.close()
    ctx.term()


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ROLES:
        print(f"usage: python -m kvsim.bench.transport {{{','.join(ROLES)}}} JOB.json OUT.json",
              file=sys.stderr)
        return 2
    role, job_path, out = argv
    job = json.loads(Path(job_path).read_text())
    # as `kvsim serve` / `kvsim send` run (and the raw peers alike): freed memory is kept,
    # so a request's buffers reuse the last one's pages instead of faulting in fresh ones
    from kvsim.transport.memory import retain_freed_memory

    retain_freed_memory(f"bench transport {role}")
    {"rx-transport": _rx_transport, "rx-raw": _rx_raw, "tx": _tx}[role](job, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
