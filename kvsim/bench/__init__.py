"""Benchmarks: measured sizes, errors and speeds, each reported against a baseline from the
same run."""
