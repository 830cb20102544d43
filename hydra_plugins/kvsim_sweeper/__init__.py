"""kvsim's Hydra plugins: the resuming sweeper of `kvsim sweep`."""
