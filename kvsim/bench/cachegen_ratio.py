"""Re-measure CacheGen's coded bits per symbol (the data behind its size estimate) on a real
capture or on synthetic KV, and write data/cachegen_ratio.json with its provenance:

    python -m kvsim.bench.cachegen_ratio --capture smollm2-135m-ctx1024 --out PATH

(the shipped file, data/cachegen_ratio.json, changes only when --out names it and --overwrite
is given; an existing file is never replaced without --overwrite).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvsim.core.layout import KVShape
from kvsim.core.outputs import OutputExistsError, check_new
from kvsim.kernels.cachegen.codec import RATIO_FILE, write_ratio_file
from kvsim.kv.capture_file import load_capture, resolve_capture_path
from kvsim.kv.synthetic import SyntheticKVParams, generate_kv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvsim.bench.cachegen_ratio",
                                     description="Measure CacheGen's coded bits per symbol.")
    parser.add_argument("--capture", help="capture name or path (default: synthetic KV)")
    parser.add_argument("--out", required=True,
                        help=f"where to write (the shipped file is {RATIO_FILE}; name it "
                             "explicitly to replace it)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out if it exists (else refused before measuring)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", default="8,4,2048,128",
                   help="layers,kv_heads,tokens,head_dim of the synthetic KV")
    args = parser.parse_args(argv)
    try:
        check_new([Path(args.out)], args.overwrite, "--overwrite")
    except OutputExistsError as exc:
        parser.error(str(exc))
    if args.capture:
        cap = load_capture(args.capture)
        kv = cap.kv
        source = {"kind": "capture", "path": str(resolve_capture_path(args.capture)),
                  "meta": cap.meta}
    else:
        dims = [int(v) for v in args.shape.split(",")]
        if len(dims) != 4:
            parser.error("--shape needs layers,kv_heads,tokens,head_dim")
        params = SyntheticKVParams()
        kv = generate_kv(KVShape(*dims, dtype="bfloat16"), params, seed=args.seed)
        source = {"kind": "synthetic", "note": "SYNTHETIC KV (kvsim.kv.synthetic.generate_kv), "
                  "not a real model capture; re-measure on a capture for real estimates",
                  "seed": args.seed, "synthetic_params": params.to_dict()}
    path = write_ratio_file(kv, source, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
