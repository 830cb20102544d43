"""Page geometry of the fused KIVI-family CPU kernels (kivi/cpu.py).

The codec classes that build a geometry (kivi.py, gear.py) import it from here, so they can
describe a cache without importing the numba module.

`geo` (int64 [pages, GEO_COLS]): the token split of page p and the byte offset of each field
inside its chunk (-1: the codec has no such field); a chunk (l, p) starts at
l * layer_bytes + geo[p, G_BASE] in the buffer of all chunks.
"""

(G_T0, G_QK, G_QV, G_RK, G_RV, G_KC, G_KS, G_KZ, G_VC, G_VS, G_VZ, G_KR, G_VR, G_BASE,
 G_RANK, G_LA, G_LB, G_KK, G_KV, G_KOI, G_KOV, G_VOI, G_VOV, G_KN, G_VN) = range(25)
GEO_COLS = 25
# the geo column of each payload field's offset
GEO_FIELDS = {"k_codes": G_KC, "k_scale": G_KS, "k_zero": G_KZ, "v_codes": G_VC,
              "v_scale": G_VS, "v_zero": G_VZ, "k_resid": G_KR, "v_resid": G_VR,
              "lr_a": G_LA, "lr_b": G_LB, "ko_idx": G_KOI, "ko_val": G_KOV, "vo_idx": G_VOI,
              "vo_val": G_VOV, "k_norm": G_KN, "v_norm": G_VN}
