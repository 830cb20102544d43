"""`kvsim quality`: capture, codec error and speculative acceptance on a real model.

For each of `runs` contexts (real text, seeds seed..seed+runs-1):
  prefill the context at the model's precision (reference KV, post-RoPE), run the held-out
  continuation on it (real decode queries + reference logits);
  for each codec and each stream prefix k: encode, decode k streams, measure attention vNMSE
  per layer, relative MSE, top-1 agreement and perplexity on the held-out tokens;
  for stream prefixes selected by speculative.prefixes: one speculative round per decoding
  mode (draft on the prefix cache, verify on the full-precision cache).
Rows average over contexts. Writes the acceptance models (acceptance/), the vNMSE table
(vnmse/), the first context's capture (captures/) and the synthetic-KV calibration (synthetic/)
under the run directory, or under out_dir (out_dir=data: the repository's data/).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from omegaconf import MISSING
from tqdm import tqdm

from kvsim.core.layout import DTYPES
from kvsim.kernels.presets import CodecSpec, preset_names, resolve_codec
from kvsim.kv.capture import run_context
from kvsim.kv.draft_verify import DECODINGS, speculative_round, survival_curve
from kvsim.kv.text import SOURCES, assemble
from kvsim.model.spec import ModelSpec
from kvsim.quality.calibrate import calibrate, save_calibration
from kvsim.quality.outputs import acceptance_name, plan_outputs
from kvsim.quality.vnmse import VNMSETable, cache_error, perplexity
from kvsim.scenario.acceptance import AcceptanceModel

PREFIX_MODES = ("partial", "all", "none")


@dataclass
class AcceptanceRunConfig:
    max_draft: int = 64  # draft tokens proposed per round
    decoding: list[str] = field(default_factory=lambda: ["greedy"])  # greedy | sampling
    temperature: float = 1.0  # sampling temperature (draft and target)
    # which (codec, stream prefix) get acceptance runs: partial = prefixes short of all
    # streams (anchor-only ...), all = every prefix incl. a monolithic codec's full
    # precision, none = skip speculative decoding
    prefixes: str = "partial"


@dataclass
class QualityConfig:
    model: ModelSpec = MISSING  # conf/model/<preset> (`model=llama-3.1-8b model.path=DIR`)
    cache_dir: str | None = None  # model cache (kvsim model fetch)
    threads: int = 1
    dtype: str = "float32"  # model compute dtype; the reference cache has this dtype
    codecs: list[Any] = field(default_factory=lambda: ["all"])  # presets, mappings, or "all"
    context_tokens: int = 1024
    heldout_tokens: int = 32  # teacher-forced continuation: queries, top-1, perplexity
    text_source: str = "stdlib-docs"
    seed: int = 0
    runs: int = 2  # contexts (text seeds) averaged over; one speculative round each
    speculative: AcceptanceRunConfig = field(default_factory=AcceptanceRunConfig)
    write_files: bool = True  # acceptance models, vNMSE table, capture, calibration
    # root for those files (acceptance/, vnmse/, captures/, synthetic/); null: the run
    # directory; `data` updates the repository's data/, which the simulator reads by name
    out_dir: str | None = None
    overwrite: bool = False  # replace existing files (else refused before the model loads)
    tag: str = ""  # appended to output names, e.g. "-long"
    capture_dtype: str = "bfloat16"
    progress: bool = True


def _codec_specs(entries: list[Any]) -> list[CodecSpec]:
    names: list[Any] = []
    for entry in entries:
        names.extend(preset_names() if entry == "all" else [entry])
    if not names:
        raise ValueError("quality: `codecs` is empty")
    return [resolve_codec(e) for e in names]


def _load(cfg: QualityConfig) -> tuple[Any, Any, str, dict]:
    from kvsim.model.load import load_lm

    lm = load_lm(cfg.model, cfg.cache_dir, cfg.dtype, cfg.threads, cfg.seed)
    return lm.model, lm.tokenizer, lm.name, {**lm.meta, "load_s": lm.load_s}


def _check(cfg: QualityConfig) -> None:
    if cfg.context_tokens < 16 or cfg.heldout_tokens < 2 or cfg.runs < 1:
        raise ValueError("quality: need context_tokens >= 16, heldout_tokens >= 2, runs >= 1")
    if cfg.text_source not in SOURCES:
        raise ValueError(f"quality: text_source must be one of {SOURCES}")
    if cfg.speculative.prefixes not in PREFIX_MODES:
        raise ValueError(f"quality: speculative.prefixes must be one of {PREFIX_MODES}")
    bad = [d for d in cfg.speculative.decoding if d not in DECODINGS]
    if bad:
        raise ValueError(f"quality: unknown decoding {bad}; choose from {DECODINGS}")
    if cfg.speculative.max_draft < 1:
        raise ValueError("quality: speculative.max_draft must be >= 1")
    if cfg.capture_dtype not in DTYPES:
        raise ValueError(f"quality: capture_dtype must be one of {sorted(DTYPES)}")


def _speculates(spec_mode: str, streams_used: int, num_streams: int) -> bool:
    """Whether a stream prefix gets speculative rounds (see AcceptanceRunConfig.prefixes)."""
    return spec_mode == "all" or (spec_mode == "partial" and streams_used < num_streams)


def run_quality(cfg: QualityConfig) -> tuple[list[dict], dict]:
    """Returns (rows, summary with wall times and the files written)."""
    _check(cfg)
    specs = _codec_specs(cfg.codecs)
    codecs = [(spec, spec.build()) for spec in specs]
    spec_mode = cfg.speculative.prefixes
    outputs = None
    if cfg.write_files:  # named and checked before the model loads
        names = [acceptance_name(cfg.model.name, spec.label, k, d, cfg.tag)
                 for spec, codec in codecs for k in range(1, codec.num_streams + 1)
                 if _speculates(spec_mode, k, codec.num_streams)
                 for d in cfg.speculative.decoding]
        outputs = plan_outputs(cfg.out_dir, cfg.model.name, cfg.context_tokens, cfg.tag, names,
                               cfg.model.random_init, cfg.overwrite)
    started = time.perf_counter()
    model, tokenizer, model_name, model_meta = _load(cfg)
    # one accumulator per (codec label, streams_used)
    acc: dict[tuple[str, int], dict] = {}
    for spec, codec in codecs:
        for k in range(1, codec.num_streams + 1):
            acc[(spec.label, k)] = {"codec": spec.label, "codec_name": spec.name,
                                    "streams_used": k, "num_streams": codec.num_streams,
                                    "stream": codec.stream_names()[k - 1], "vnmse_layers": [],
                                    "relative_mse": [], "top1": [], "ppl": [], "ppl_ref": [],
                                    "bits": [], "encode_s": [], "decode_s": [],
                                    "accepted": {d: [] for d in cfg.speculative.decoding},
                                    "draft_s": {d: [] for d in cfg.speculative.decoding}}
    files: dict[str, str] = {}
    timing = {"load_s": model_meta.get("load_s", 0.0), "prefill_s": [], "draft_tokens_s": []}
    texts = []
    steps = cfg.runs * sum(c.num_streams for _, c in codecs)
    bar = tqdm(total=steps, desc="quality", file=sys.stderr, disable=not cfg.progress)
    for run in range(cfg.runs):
        sample = assemble(tokenizer, cfg.context_tokens + cfg.heldout_tokens, cfg.text_source,
                          cfg.seed + run)
        texts.append(sample.describe())
        context, heldout = sample.ids[: cfg.context_tokens], sample.ids[cfg.context_tokens:]
        held = torch.tensor(heldout)
        ref = run_context(model, context, heldout)
        timing["prefill_s"].append(ref.prefill_s)
        ppl_ref = perplexity(ref.heldout_logits[:-1], held[1:])
        if run == 0 and outputs is not None:
            meta = {"model": model_name, **sample.describe()}
            path = ref.to_capture(meta, DTYPES[cfg.capture_dtype]).save(outputs.capture)
            files["capture"] = str(path)
            rope_base = _rope_base(model.config)
            params = calibrate(ref.kv, rope_base)
            files["synthetic"] = str(save_calibration(
                params, outputs.synthetic.stem,
                {"model": model_name, "capture": str(path), "rope_base": rope_base,
                 "context_tokens": cfg.context_tokens, **sample.describe()},
                outputs.synthetic.parent))
        gen = torch.Generator().manual_seed(cfg.seed + run)
        first = {"greedy": int(ref.last_logits.argmax())}
        if "sampling" in cfg.speculative.decoding:
            probs = torch.softmax(ref.last_logits.double() / cfg.speculative.temperature, -1)
            first["sampling"] = int(torch.multinomial(probs, 1, generator=gen))
        for spec, codec in codecs:
            t0 = time.perf_counter()
            enc = codec.encode(ref.kv)
            encode_s = time.perf_counter() - t0
            for k in range(1, codec.num_streams + 1):
                bar.set_postfix_str(f"run {run} {spec.label} s{k}")
                t0 = time.perf_counter()
                kv_hat = codec.decode(enc, streams=k, dtype=ref.kv.dtype)
                a = acc[(spec.label, k)]
                a["decode_s"].append(time.perf_counter() - t0)
                a["encode_s"].append(encode_s)
                a["bits"].append(enc.bits_per_element(k))
                err = cache_error(model, ref.kv, kv_hat, ref.queries, held, ref.heldout_logits)
                a["vnmse_layers"].append(err.vnmse_per_layer)
                a["relative_mse"].append(err.relative_mse)
                a["top1"].append(err.top1_agreement)
                a["ppl"].append(err.ppl)
                a["ppl_ref"].append(ppl_ref)
                if _speculates(spec_mode, k, codec.num_streams):
                    for decoding in cfg.speculative.decoding:
                        t0 = time.perf_counter()
                        rnd = speculative_round(model, kv_hat, ref.kv, first[decoding],
                                                cfg.speculative.max_draft, decoding,
                                                cfg.speculative.temperature, cfg.seed + run)
                        dt = time.perf_counter() - t0
                        a["accepted"][decoding].append(rnd.accepted)
                        a["draft_s"][decoding].append(dt)
                        timing["draft_tokens_s"].append(dt / cfg.speculative.max_draft)
                bar.update(1)
    bar.close()
    provenance = {"model": model_name, "context_tokens": cfg.context_tokens,
                  "heldout_tokens": cfg.heldout_tokens, "text_source": cfg.text_source,
                  "text_seeds": list(range(cfg.seed, cfg.seed + cfg.runs)),
                  "text": [t["text_sha256"] for t in texts], "runs": cfg.runs,
                  "model_dtype": cfg.dtype, "reference": "model-precision cache (rope: post)"}
    rows: list[dict] = []
    table_rows: list[dict] = []
    for a in acc.values():
        layers = np.mean(np.stack(a["vnmse_layers"]), axis=0)
        base = {"codec": a["codec"], "streams_used": a["streams_used"], "stream": a["stream"],
                "num_streams": a["num_streams"], "bits_per_element": float(np.mean(a["bits"])),
                "vnmse": float(layers.mean()), "vnmse_per_layer": layers.tolist(),
                "relative_mse": float(np.mean(a["relative_mse"])),
                "top1_agreement": float(np.mean(a["top1"])),
                "ppl_ref": float(np.mean(a["ppl_ref"])), "ppl": float(np.mean(a["ppl"])),
                "encode_s": float(np.mean(a["encode_s"])),
                "decode_s": float(np.mean(a["decode_s"])), "model": model_name,
                "context_tokens": cfg.context_tokens, "runs": cfg.runs, "source": "measured"}
        base["ppl_delta"] = base["ppl"] - base["ppl_ref"]
        table_rows.append({k: v for k, v in base.items() if k not in ("model",)})
        measured = [d for d in cfg.speculative.decoding if a["accepted"][d]]
        if not measured:
            rows.append({**base, "decoding": None, "proposed_mean": None, "accepted_mean": None,
                         "survival": None})
        for decoding in measured:
            accepted = a["accepted"][decoding]
            curve = survival_curve(accepted, cfg.speculative.max_draft)
            name = acceptance_name(cfg.model.name, a["codec"], a["streams_used"], decoding,
                                   cfg.tag)
            row = {**base, "decoding": decoding, "proposed_mean": cfg.speculative.max_draft,
                   "accepted_mean": float(np.mean(accepted)), "accepted": accepted,
                   "survival": {k: s for k, s in enumerate(curve)},
                   "draft_verify_s": float(np.mean(a["draft_s"][decoding])),
                   "acceptance_model": name}
            if outputs is not None:
                model_file = AcceptanceModel(name, curve, "measured", {
                    **provenance, "codec": a["codec"], "streams_used": a["streams_used"],
                    "stream": a["stream"], "decoding": decoding,
                    "temperature": cfg.speculative.temperature if decoding == "sampling"
                    else None, "max_draft": cfg.speculative.max_draft,
                    "target": "full-precision cache", "accepted": accepted,
                    "proposed": [cfg.speculative.max_draft] * len(accepted)})
                files[f"acceptance:{name}"] = str(model_file.save(outputs.acceptance[name]))
            rows.append(row)
    if outputs is not None:
        table = VNMSETable(outputs.vnmse.stem, table_rows,
                           {**provenance, "query_tokens": cfg.heldout_tokens})
        files["vnmse"] = str(table.save(outputs.vnmse))
    summary = {"wall_s": time.perf_counter() - started, "load_s": timing["load_s"],
               "prefill_s_mean": float(np.mean(timing["prefill_s"])),
               "draft_s_per_token": float(np.mean(timing["draft_tokens_s"]))
               if timing["draft_tokens_s"] else None, "files": files, "model": model_meta}
    return rows, summary


def _rope_base(config: Any) -> float | None:
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        return None  # scaled RoPE variants: calibration then treats keys as rotation-free
    return float(params.get("rope_theta") or getattr(config, "rope_theta", 10000.0))
