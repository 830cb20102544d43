"""Measure the published shape of the Azure LLM inference traces 2023 (code and conversation)
and write the statistics a workload generator needs, never the rows themselves:

    python -m kvsim.bench.azure_shape --code AzureLLMInferenceTrace_code.csv \
        --conv AzureLLMInferenceTrace_conv.csv --source-commit SHA --out DIR

writes DIR/azure-2023-code.json and DIR/azure-2023-conv.json. --out is required and nothing is
written into data/ unless --out names it (the shipped files are data/workload/); an existing
file is replaced only with --overwrite.

Per trace: an empirical quantile table of ContextTokens and of GeneratedTokens (tokens), their
Spearman rank correlation (and the Gaussian-copula correlation that reproduces it), and the
arrival process: mean rate (requests/s), inter-arrival gaps (s: quantiles, coefficient of
variation) and burstiness (Goh-Barabasi B = (CV - 1) / (CV + 1), 0 for Poisson; the index of
dispersion of request counts per window, 1 for Poisson).

Source: Azure/AzurePublicDataset, AzureLLMInferenceDataset2023.md (CC-BY). Attribution asked
by the dataset: Patel et al., "Splitwise: Efficient generative LLM inference using phase
splitting", ISCA 2024.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from kvsim.core.data_files import sha256_file
from kvsim.core.outputs import OutputExistsError, check_new
from kvsim.scenario.request_trace import load_request_trace

TRACES = ("code", "conv")
SOURCE_REPO = "Azure/AzurePublicDataset"
SOURCE_PATHS = {t: f"data/AzureLLMInferenceTrace_{t}.csv" for t in TRACES}
LICENSE = "CC-BY (https://github.com/Azure/AzurePublicDataset/blob/master/LICENSE)"
ATTRIBUTION = ("Pratyush Patel, Esha Choukse, Chaojie Zhang, Aashaka Shah, Inigo Goiri, Saeed "
               "Maleki, Ricardo Bianchini. \"Splitwise: Efficient generative LLM inference "
               "using phase splitting\", ISCA 2024.")
# quantile probabilities: every percent, and finer in both tails (the tails set the load
# of the longest prompts and outputs)
PROBS = np.unique(np.round(np.concatenate([
    np.linspace(0.0, 1.0, 101),
    [0.0001, 0.0005, 0.001, 0.002, 0.005, 0.995, 0.998, 0.999, 0.9995, 0.9999]]), 6))
DISPERSION_WINDOWS_S = (1.0, 10.0, 60.0)  # count windows for the index of dispersion


def shape_file_name(trace: str) -> str:
    return f"azure-2023-{trace}.json"


def quantile_table(values: np.ndarray) -> dict:
    """Quantiles at PROBS (numpy's default linear interpolation between order statistics)."""
    v = np.asarray(values, dtype=float)
    return {"p": [float(p) for p in PROBS],
            "value": [float(q) for q in np.quantile(v, PROBS)],
            "mean": float(v.mean()), "min": float(v.min()), "max": float(v.max())}


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (ties get their average rank)."""
    from scipy.stats import rankdata

    ra, rb = rankdata(a), rankdata(b)
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def copula_rho(rho_spearman: float) -> float:
    """Pearson correlation of a Gaussian copula whose Spearman correlation is rho_spearman
    (rho_s = 6/pi * asin(rho / 2) for a bivariate normal)."""
    return float(2.0 * math.sin(math.pi * rho_spearman / 6.0))


def index_of_dispersion(arrival_s: np.ndarray, window_s: float) -> float:
    """Variance / mean of request counts in consecutive windows of window_s (1 for Poisson,
    > 1 for bursty arrivals); NaN when the trace spans fewer than two windows."""
    n_windows = int(arrival_s[-1] // window_s) + 1
    if n_windows < 2:
        return float("nan")
    counts = np.bincount((arrival_s // window_s).astype(int), minlength=n_windows)
    return float(counts.var() / counts.mean())


def arrival_shape(arrival_s: np.ndarray) -> dict:
    """Rate and inter-arrival statistics of arrival times (s, from the first request)."""
    duration_s = float(arrival_s[-1] - arrival_s[0])
    if len(arrival_s) < 3 or duration_s <= 0:
        raise ValueError("the trace needs at least 3 requests spanning a positive time "
                         "to measure its arrivals")
    gaps_s = np.diff(arrival_s)
    cv = float(gaps_s.std() / gaps_s.mean())
    return {
        "duration_s": duration_s,
        "mean_rate_per_s": (len(arrival_s) - 1) / duration_s,
        "interarrival_s": quantile_table(gaps_s) | {"cv": cv},
        "burstiness_b": (cv - 1.0) / (cv + 1.0),
        "count_dispersion": {"window_s": list(DISPERSION_WINDOWS_S),
                             "variance_over_mean": [index_of_dispersion(arrival_s, w)
                                                    for w in DISPERSION_WINDOWS_S]},
    }


def measure(path: str | Path, trace: str, source_commit: str, note: str = "") -> dict:
    """The shape statistics of one trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)."""
    tr = load_request_trace(path)
    rho_s = spearman(tr.context_tokens, tr.output_tokens)
    source = {"dataset": "Azure LLM inference trace 2023",
              "repo": SOURCE_REPO, "path": SOURCE_PATHS[trace], "commit": source_commit,
              "description": "AzureLLMInferenceDataset2023.md", "license": LICENSE,
              "attribution": ATTRIBUTION,
              "input_sha256": sha256_file(path), "rows": int(len(tr.context_tokens))}
    if note:
        source["note"] = note
    return {
        "trace": trace,
        "source": source,
        "units": "tokens for ContextTokens and GeneratedTokens; s and requests/s for arrivals",
        "context_tokens": quantile_table(tr.context_tokens),
        "generated_tokens": quantile_table(tr.output_tokens),
        "rank_correlation": {"spearman": rho_s, "gaussian_copula_rho": copula_rho(rho_s)},
        "arrivals": arrival_shape(tr.arrival_s),
        "generated_by": "python -m kvsim.bench.azure_shape",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvsim.bench.azure_shape",
                                     description="Measure the Azure LLM inference traces 2023.")
    parser.add_argument("--code", help="AzureLLMInferenceTrace_code.csv")
    parser.add_argument("--conv", help="AzureLLMInferenceTrace_conv.csv")
    parser.add_argument("--out", required=True,
                        help="directory to write azure-2023-<trace>.json into (the shipped "
                             "files are in data/workload/; name it explicitly to replace them)")
    parser.add_argument("--source-commit", default="",
                        help=f"the {SOURCE_REPO} commit the CSVs come from (recorded)")
    parser.add_argument("--note", default="", help="recorded with the source (e.g. a subset)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace existing files (else refused before measuring)")
    args = parser.parse_args(argv)
    inputs = {t: getattr(args, t) for t in TRACES if getattr(args, t)}
    if not inputs:
        parser.error("give --code and/or --conv")
    out_dir = Path(args.out)
    targets = {t: out_dir / shape_file_name(t) for t in inputs}
    try:
        check_new(list(targets.values()), args.overwrite, "--overwrite")
    except OutputExistsError as exc:
        parser.error(str(exc))
    out_dir.mkdir(parents=True, exist_ok=True)
    for trace, path in inputs.items():
        shape = measure(path, trace, args.source_commit, args.note)
        targets[trace].write_text(json.dumps(shape, indent=1) + "\n")
        ctx, gen = shape["context_tokens"], shape["generated_tokens"]
        arr = shape["arrivals"]
        med = PROBS.tolist().index(0.5)
        p90 = PROBS.tolist().index(0.9)
        print(f"{trace}: {shape['source']['rows']} rows, context p50/p90 "
              f"{ctx['value'][med]:.0f}/{ctx['value'][p90]:.0f} tokens, generated p50/p90 "
              f"{gen['value'][med]:.0f}/{gen['value'][p90]:.0f} tokens, spearman "
              f"{shape['rank_correlation']['spearman']:.3f}, rate "
              f"{arr['mean_rate_per_s']:.2f}/s, inter-arrival CV "
              f"{arr['interarrival_s']['cv']:.2f} -> {targets[trace]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
