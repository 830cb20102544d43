"""Measured profiles of this machine and its emulated links, for the simulator to load."""
