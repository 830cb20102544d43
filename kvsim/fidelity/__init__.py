"""The simulator against the real transport: paired runs and their relative errors."""
