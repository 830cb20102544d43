"""Discrete-event simulator of disaggregated inference with KV-cache transfer (simpy)."""
