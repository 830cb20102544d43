"""What `kvsim <command> --help` and `kvsim list` print: the command's groups and their
presets (each with its file's first comment line), the scenarios with the grids they declare,
and the resolved config with every field's comment (units, allowed values) taken from the
schema dataclasses' source and the command's YAML file.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import tokenize
from functools import cache
from pathlib import Path
from typing import Any

from kvsim.cli.keys import group_options
from kvsim.core.paths import CONF_DIR

# groups of conf/ that are not presets of a command's config
_NOT_GROUPS = {"scenario"}


def preset_summary(path: Path) -> str:
    """The first comment line of a preset file (or its `title:`), shortened to one line."""
    title = ""
    for line in path.read_text().splitlines():
        text = line.strip()
        if text.startswith("#") and not text.startswith("# @package"):
            return text.lstrip("# ").strip()
        if text.startswith("title:"):
            title = text.split(":", 1)[1].strip().strip("\"'")
    return title


def declared_grid(path: Path) -> dict[str, str]:
    """`hydra.sweeper.params` of a scenario file: {key: 'a,b,c'}."""
    import yaml

    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        return {}
    params = ((doc.get("hydra") or {}).get("sweeper") or {}).get("params") or {}
    return {str(k): str(v) for k, v in params.items()}


def list_groups(args: list[str]) -> str:
    """`kvsim list`: every group and its presets; `kvsim list GROUP`: one group, described."""
    groups = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())
    if not args:
        lines = ["groups (kvsim list GROUP describes one; choose with GROUP=PRESET):"]
        for g in groups:
            lines.append(f"  {g:<10} {', '.join(group_options(g))}")
        return "\n".join(lines)
    if len(args) > 1:
        raise ValueError("usage: kvsim list [group]")
    group = args[0]
    if group not in groups:
        from kvsim.cli.keys import closest

        hint = closest(group, groups)
        raise ValueError(f"no group {group!r}" + (f"; did you mean {hint!r}?" if hint else "")
                         + f" (groups: {', '.join(groups)})")
    return "\n".join([f"{group} presets (conf/{group}/*.yaml):"] + _describe_group(group))


def _describe_group(group: str) -> list[str]:
    lines = []
    names = group_options(group)
    width = max((len(n) for n in names), default=0)
    for name in names:
        path = CONF_DIR / group / f"{name}.yaml"
        line = f"  {name:<{width}}  {preset_summary(path)}"
        grid = declared_grid(path)
        if grid:
            line += "\n  " + " " * width + "  grid (-m): " + " ".join(
                f"{k}={v}" for k, v in grid.items())
        lines.append(line)
    return lines


@cache
def field_comments(cls: type) -> dict[str, str]:
    """{field: comment} for a dataclass: the comment on the field's line, or the comment
    lines right above it."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    def comment_only(n: int) -> bool:
        return 1 <= n <= len(lines) and lines[n - 1].strip().startswith("#")

    out: dict[str, str] = {}
    tree = ast.parse(source)
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    fields = [n for n in body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    continued: set[int] = set()  # comment lines that continue the field above's comment
    for node, nxt in zip(fields, fields[1:] + [None], strict=True):
        end = node.end_lineno or node.lineno
        if not comments.get(node.lineno):
            continue
        n = end + 1
        while comment_only(n):
            n += 1
        if nxt is not None and n == nxt.lineno and comments.get(nxt.lineno) and n > end + 1:
            continued.update(range(end + 1, n))  # the next field has its own comment
    for node in fields:
        assert isinstance(node.target, ast.Name)
        line_no = node.lineno
        text = comments.get(line_no, "")
        after = []
        n = (node.end_lineno or line_no) + 1
        while n in continued:
            after.append(comments.get(n, ""))
            n += 1
        if text:
            text = " ".join([text, *after])
        else:
            above = []
            n = line_no - 1
            while comment_only(n) and n not in continued:
                above.insert(0, comments.get(n, ""))
                n -= 1
            text = " ".join(a for a in above if a)
        if text:
            out[node.target.id] = text
    return out


def _yaml_comments(config_name: str) -> dict[str, str]:
    """Top-level `key: value  # comment` comments of conf/<config_name>.yaml."""
    path = CONF_DIR / f"{config_name}.yaml"
    out: dict[str, str] = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z_][\w]*):[^#]*#\s*(.+)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def _render(value: Any, schema: type | None, indent: int, yaml_notes: dict[str, str],
            lines: list[str]) -> None:
    notes = field_comments(schema) if schema is not None and dataclasses.is_dataclass(schema) \
        else {}
    fields = {f.name: f for f in dataclasses.fields(schema)} \
        if schema is not None and dataclasses.is_dataclass(schema) else {}
    for key, item in value.items():
        note = notes.get(key) or (yaml_notes.get(key) if indent == 0 else "")
        sub_schema = None
        if key in fields:
            ftype = fields[key].type
            sub_schema = _resolve_type(schema, ftype)
        pad = "  " * indent
        if isinstance(item, dict) and item:
            lines.append(f"{pad}{key}:" + (f"  # {note}" if note else ""))
            _render(item, sub_schema, indent + 1, yaml_notes, lines)
        else:
            shown = _short(item)
            lines.append(f"{pad}{key}: {shown}" + (f"  # {note}" if note else ""))


def _resolve_type(owner: type, annotation: Any) -> type | None:
    """The dataclass behind a field annotation (string annotations resolved in the owner's
    module), or None."""
    if isinstance(annotation, str):
        module = sys.modules.get(owner.__module__)
        annotation = getattr(module, annotation, None) if module else None
    return annotation if dataclasses.is_dataclass(annotation) else None


def _short(value: Any) -> str:
    import json

    text = json.dumps(value, default=str)
    return text if len(text) <= 90 else text[:87] + "..."


def command_help(name: str, mod: Any, overrides: list[str]) -> str:
    """`kvsim <command> --help`: what it does, how to run it, its groups, scenarios and config
    (resolved with the given overrides) with every field's comment."""
    import textwrap

    from kvsim.core.compose import compose

    schema = getattr(mod, "Config", None)
    try:
        _, plain = compose(mod.CONFIG_NAME, list(overrides), schema)
    except Exception as exc:  # composition errors: say which override
        raise ValueError(f"bad configuration: {str(exc).strip()}") from None
    doc = textwrap.dedent(mod.__doc__ or mod.HELP).strip()
    lines = [f"kvsim {name}: {doc}", "",
             f"usage: kvsim {name} [key=value ...] [report=PATH]",
             f"       kvsim {name} -m key=a,b [key2=x,y ...]   (every combination, "
             "Hydra multirun)",
             f"       kvsim {name} --cfg job | --info | --hydra-help | hydra.run.dir=DIR",
             "Each run writes report.json and .hydra/ into its run directory "
             f"(outputs/<date>/<time>-{name.replace(' ', '_')}/ by default).", ""]
    groups = [g for g in plain if (CONF_DIR / g).is_dir() and g not in _NOT_GROUPS]
    if groups:
        lines.append("groups (GROUP=PRESET; `kvsim list GROUP` describes each preset):")
        for g in groups:
            current = plain[g].get("name", "") if isinstance(plain[g], dict) else ""
            lines.append(f"  {g:<10} [{current}] " + ", ".join(group_options(g)))
        lines.append("")
    yaml_text = (CONF_DIR / f"{mod.CONFIG_NAME}.yaml").read_text()
    if re.search(r"^\s*-\s*scenario\s*:", yaml_text, flags=re.M):  # a defaults-list entry
        lines.append("scenarios (scenario=NAME; `kvsim " + name +
                     " -m scenario=NAME` runs the grid a scenario declares):")
        lines += _describe_group("scenario")
        lines.append("")
    lines.append(f"config (conf/{mod.CONFIG_NAME}.yaml with the overrides given; "
                 "# the field's meaning, unit and allowed values):")
    _render(plain, schema, 1, _yaml_comments(mod.CONFIG_NAME), lines)
    return "\n".join(lines)
