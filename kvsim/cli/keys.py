"""Check a command line's overrides before Hydra runs anything: unknown keys and unknown group
options fail with the closest valid name ("did you mean link.bandwidth_gbps?"), never with a
hint to append them (`+key=` would store a key nothing reads); a value of the wrong type fails
with the key named. Sweeps (`key=a,b`) are checked on their first value; Hydra's sweeper
composes every job again before launching.
"""

from __future__ import annotations

import difflib
from typing import Any

from kvsim.core.paths import CONF_DIR


class OverrideError(ValueError):
    pass


# keys that were renamed: the old spelling fails with the new one (before Hydra runs, so
# the schemas carry no placeholder fields for them)
RENAMED = {"llm": "model", "llms": "models", "transport.llm": "model"}


def closest(word: str, candidates: list[str]) -> str | None:
    """The candidate nearest to `word` (difflib ratio >= 0.6), or None."""
    found = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    if found:
        return found[0]
    # a key's last part is often right while its parent is missing (bandwidth_gbps=25)
    tail = [c for c in candidates if c.rsplit(".", 1)[-1] == word.rsplit(".", 1)[-1]]
    return tail[0] if len(tail) == 1 else None


def group_options(group: str) -> list[str]:
    folder = CONF_DIR / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def is_group(key: str) -> bool:
    return "." not in key and (CONF_DIR / key).is_dir()


def dotted_keys(node: Any, prefix: str = "") -> list[str]:
    """Every key path of a composed config (inner nodes and leaves)."""
    from omegaconf import DictConfig

    out: list[str] = []
    if isinstance(node, DictConfig):
        for key in node.keys():
            path = f"{prefix}{key}"
            out.append(path)
            out += dotted_keys(node._get_node(key), f"{path}.")
    return out


def _known(cfg: Any, key: str) -> bool:
    """Does `key` name a node of the composed config (or a place an open mapping accepts)?"""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    node = cfg
    for part in key.split("."):
        if isinstance(node, DictConfig):
            if node._is_none():
                return True  # an Any-typed field holding null: its value is free-form
            if part not in node:
                return not OmegaConf.is_struct(node)
            node = node._get_node(part)
        elif isinstance(node, ListConfig):
            if not part.isdigit() or int(part) >= len(node):
                return False
            node = node._get_node(int(part))
        else:
            return getattr(node, "_is_none", lambda: False)()
    return True


def _compose(config_name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name=config_name, overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


def _message(exc: Exception) -> str:
    msg = str(exc).strip()
    if exc.__cause__ is not None and str(exc.__cause__).strip() not in msg:
        msg += f"\n  {str(exc.__cause__).strip().splitlines()[0]}"
    return msg


def check_overrides(config_name: str, schema: type | None, overrides: list[str]) -> list[str]:
    """Raise OverrideError naming the first bad override (and the closest valid name), or
    one the composed config's own checks (its validate()) refuse. Returns the overrides to
    run: a scalar given for a list key becomes a one-item list (codecs=int8 ->
    codecs=[int8])."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from kvsim.core.compose import register_schema

    register_schema(config_name, schema)
    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        try:
            parsed.append(parser.parse_override(text))
        except Exception as exc:  # Hydra's parser raises HydraException / OverrideParseException
            raise OverrideError(f"cannot parse {text!r}: overrides look like key=value "
                                f"(or key=a,b with -m)\n  {str(exc).strip().splitlines()[0]}"
                                ) from None
    groups, values = [], []
    for o in parsed:
        key = o.key_or_group
        if key.startswith(("hydra.", "hydra/")) or key == "hydra":
            continue  # Hydra's own settings: Hydra checks them
        old = next((k for k in RENAMED if key == k or key.startswith(f"{k}.")), None)
        if old is not None:
            raise OverrideError(f"`{old}=` was renamed to `{RENAMED[old]}=` "
                                f"({o.input_line} -> {RENAMED[old]}{key[len(old):]}=...)")
        if is_group(key) and not _selects(config_name, key):
            hint = closest(f"{key}s", _schema_keys(schema)) or closest(key, _schema_keys(schema))
            value = o.get_value_element_as_str()
            raise OverrideError(
                f"{key}={value}: `{key}` is not a setting of this command" +
                (f"; did you mean {hint}=[{value}]?" if hint else "") +
                " (`--help` lists every key)")
        if is_group(key):
            options = group_options(key)
            choices = list(o.sweep_string_iterator()) if o.is_sweep_override() \
                else [o.get_value_element_as_str()]
            for choice in choices:
                if choice not in options and choice != "null":
                    hint = closest(choice, options)
                    raise OverrideError(
                        f"{key}={choice}: no such {key} preset" +
                        (f"; did you mean {key}={hint}?" if hint else "") +
                        f" (options: {', '.join(options)}; `kvsim list {key}`)")
            groups.append(f"{key}={choices[0]}")
        else:
            values.append(o)
    firsts = []
    for o in parsed:
        key = o.get_key_element()
        if key.lstrip("+~").startswith(("hydra.", "hydra/")):
            continue
        if o.is_sweep_override():
            firsts.append(f"{key}={next(iter(o.sweep_string_iterator()))}")
        else:
            firsts.append(o.input_line)
    overrides, firsts = _lists_for_scalars(schema, values, overrides, firsts)
    adds = any(o.is_add() or o.is_force_add() for o in values)
    failed: Exception | None = None  # the composition of every override, if it failed
    if not adds:  # the usual case: one composition, with every override, decides
        try:
            composed = _compose(config_name, firsts)
            _check_keys(composed, values)
            _validate(composed, schema)
            return overrides
        except OverrideError:
            raise
        except Exception as exc:  # which override is wrong: the group choices alone tell
            failed = exc
    # `+key=` composes whether or not the key exists (Hydra adds it), so keys are checked
    # against the group choices' composition; so is a failed composition's culprit found
    try:
        base = _compose(config_name, groups)
    except Exception as exc:  # Hydra composition errors of the group choices alone
        raise OverrideError(f"bad configuration: {_message(exc)}") from None
    _check_keys(base, values)
    if failed is None:
        try:
            _compose(config_name, firsts)
        except Exception as exc:
            failed = exc
    if failed is not None:  # type errors of values, e.g. link.bandwidth_gbps=abc
        raise OverrideError(f"bad configuration: {_message(failed)}") from None
    return overrides


def _selects(config_name: str, group: str) -> bool:
    """Whether conf/<config_name>.yaml chooses an option of `group` (its defaults list):
    a group folder it does not use (conf/codec/ holds the presets `codecs=[...]` names) is
    not a setting of the command."""
    import yaml

    doc = yaml.safe_load((CONF_DIR / f"{config_name}.yaml").read_text()) or {}
    for entry in doc.get("defaults") or []:
        names = entry.keys() if isinstance(entry, dict) else [entry]
        if any(str(n).lstrip("+/").split("@")[0] in (group, f"override {group}")
               for n in names):
            return True
    return False


def _schema_keys(schema: type | None) -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(schema)] if schema and \
        dataclasses.is_dataclass(schema) else []


def _lists_for_scalars(schema: type | None, values: list, overrides: list[str],
                       firsts: list[str]) -> tuple[list[str], list[str]]:
    """codecs=int8 where the schema types `codecs` as a list: codecs=[int8] (in the overrides
    to run and in the first-value ones to check); sweeps and additions are left as they
    are."""
    rewrite = {}
    for o in values:
        if o.is_sweep_override() or o.is_delete() or o.is_add() or \
                isinstance(o.value(), (list, dict)):
            continue
        if _is_list_field(schema, o.key_or_group):
            rewrite[o.input_line] = f"{o.key_or_group}=[{o.get_value_element_as_str()}]"
    if not rewrite:
        return overrides, firsts
    return [rewrite.get(x, x) for x in overrides], [rewrite.get(x, x) for x in firsts]


def _is_list_field(schema: type | None, key: str) -> bool:
    """Whether the schema's field at dotted `key` is typed as a list."""
    import dataclasses
    import typing

    node: Any = schema
    for part in key.split("."):
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return False
        try:
            node = typing.get_type_hints(node).get(part)
        except (NameError, TypeError):
            return False
    return typing.get_origin(node) is list or node is list


def _validate(composed: Any, schema: type | None) -> None:
    """The command's own checks (its Config.validate()) before anything runs: a usage error
    then exits 2 and leaves no run directory. A config that needs the running app to resolve
    (e.g. a ${hydra:...} value) is left to the run."""
    from omegaconf import OmegaConf

    if schema is None or not hasattr(schema, "validate"):
        return
    try:
        typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), composed))
    except Exception:  # an interpolation only the running app resolves: the run checks it
        return
    try:
        typed.validate()
    except (ValueError, TypeError) as exc:
        raise OverrideError(str(exc).strip().splitlines()[0]) from None


def _check_keys(base: Any, values: list) -> None:
    """Raise OverrideError for the first override of `values` naming no key of `base` (or
    adding, with `+`, a key that exists)."""
    candidates: list[str] | None = None
    for o in values:
        key = o.key_or_group
        if o.is_delete():
            continue
        if not _known(base, key):
            candidates = candidates if candidates is not None else dotted_keys(base)
            hint = closest(key, candidates)
            raise OverrideError(
                f"unknown key {key!r}" + (f"; did you mean {hint}?" if hint else "") +
                " (`--help` lists every key)")
        if o.is_add() and not o.is_force_add():
            raise OverrideError(f"+{key} adds a key, but {key!r} already exists: "
                                f"override it with {key}=...")
