"""What the two engines (kvsim.sim, kvsim.transport) share: the scenario config, its variants,
transfer policies, workloads and traces, codec timing, link profiles, the speculative-decoding
timing and acceptance models, per-request metrics and report rows, Chrome-trace events."""
