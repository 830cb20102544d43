"""Measure this machine and its emulated links for the simulator (`kvsim calibrate`)."""
