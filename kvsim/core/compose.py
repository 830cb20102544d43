"""Typed configs from conf/: compose conf/<name>.yaml with overrides (Hydra's compose API, no
application) into its dataclass schema. The entry point (kvsim.cli.main) runs commands as Hydra
applications; everything below it that needs another command's config (a validation's
simulated scenario, a calibration's emulated transfer) composes it here.
"""

from __future__ import annotations

from pathlib import Path

from kvsim.core.paths import CONF_DIR, check_root


def compose(config_name: str, overrides: list[str], schema: type | None = None):
    """Compose conf/<config_name>.yaml with overrides; return (typed config, plain dict)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    check_root()
    register_schema(config_name, schema)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=overrides)
    plain = OmegaConf.to_container(cfg, resolve=True)
    typed = OmegaConf.to_object(cfg) if schema is not None else plain
    return typed, plain


def register_schema(config_name: str, schema: type | None) -> None:
    """conf/<name>.yaml's defaults list starts with `<name>_schema`: the command's dataclass,
    which types and validates every key."""
    from hydra.core.config_store import ConfigStore

    if schema is not None:
        ConfigStore.instance().store(name=f"{config_name}_schema", node=schema)


def from_resolved(path: str, schema: type):
    """A config resolved by another kvsim process (a JSON of the typed config), e.g. the one
    `kvsim emulate` hands to the `kvsim serve` / `kvsim send` processes it starts."""
    import json

    from omegaconf import OmegaConf

    plain = json.loads(Path(path).read_text())
    cfg = OmegaConf.merge(OmegaConf.structured(schema), plain)
    return OmegaConf.to_object(cfg), plain
