"""`kvsim compare A B`: two runs side by side (kvsim.compare.runs loads them,
kvsim.compare.diff matches rows, diffs metrics against their 95% intervals, diffs configs)."""
