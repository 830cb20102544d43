"""The `kvsim` entry point (main.py), its help and override checks, and resumable sweeps.
The only package that runs Hydra applications and reads their DictConfigs."""
