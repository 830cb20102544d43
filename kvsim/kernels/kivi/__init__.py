"""The KIVI backbone family: `kivi` / `kcvt` (codec.py), `gear` / `gear-l` (gear.py, with its
outliers in outliers.py and its low-rank fit in lowrank.py, that fit's Triton kernel in
lowrank_triton.py), `oscar` (oscar.py), their fused numba CPU kernels (cpu.py), their device
path's Triton kernels (triton.py), the page geometry those share (geometry.py) and the runs of
pages a device path writes a field of at once (page_runs.py)."""
