"""What every layer shares and that imports nothing else of kvsim: the KV layout, where
configs, data and outputs live, data-file provenance, reports, range checks, config
composition, lazy imports."""
