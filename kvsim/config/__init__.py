"""Typed configuration objects (dataclass schemas) and loaders for conf/ presets."""
