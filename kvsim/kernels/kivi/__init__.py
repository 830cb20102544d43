"""The KIVI backbone family: `kivi` / `kcvt` (codec.py), `gear` / `gear-l` (gear.py), `oscar`
(oscar.py), their fused numba CPU kernels (cpu.py) and the page geometry those share
(geometry.py)."""
