"""A run's setting in words, as `kvsim sim` and `kvsim advise` print it above their tables:
the setting itself (setting_lines) and what a scenario file (conf/scenario/<name>.yaml,
`# @package _global_`) set that the command line did not (carried_over): its group choices
(`override /model: qwen3-32b` -> model=qwen3-32b) and its keys, flattened
(hardware.devices=4). Lines fit TABLE_WIDTH columns."""

from __future__ import annotations

import textwrap
from typing import Any

from kvsim.core.hydra_run import hydra_run
from kvsim.core.paths import CONF_DIR
from kvsim.scenario.config import SimConfig

TABLE_WIDTH = 120  # columns of a terminal the default tables and their headers fit

NOT_SETTINGS = ("defaults", "hydra", "title")  # a scenario's keys that set nothing of the run


def scenario_settings(name: str) -> dict[str, Any]:
    """{key: value} of conf/scenario/<name>.yaml: group choices under the group's name, other
    keys as dotted paths; {} for scenario `none` or a scenario file that is not there."""
    from omegaconf import OmegaConf

    path = CONF_DIR / "scenario" / f"{name}.yaml"
    if name == "none" or not path.is_file():
        return {}
    # as Hydra reads it (YAML 1.1 alone reads 1e-3 as a string)
    doc = OmegaConf.to_container(OmegaConf.load(path)) or {}
    out: dict[str, Any] = {}
    for entry in doc.get("defaults") or []:
        if isinstance(entry, dict):
            for key, value in entry.items():
                out[str(key).removeprefix("override ").strip().lstrip("/")] = value
    _flatten({k: v for k, v in doc.items() if k not in NOT_SETTINGS}, "", out)
    return out


def _flatten(node: dict, prefix: str, out: dict[str, Any]) -> None:
    for key, value in node.items():
        if isinstance(value, dict):
            _flatten(value, f"{prefix}{key}.", out)
        else:
            out[f"{prefix}{key}"] = value


def _format(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(_format(v) for v in value) + "]"
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def carried_over(name: str, title: str, overrides: list[str], cfg: object | None = None,
                 choices: dict[str, str] | None = None, width: int = TABLE_WIDTH) -> list[str]:
    """The lines that say what scenario `name` set and the command line did not (a key the
    overrides name, or one under a key they name, is the command line's; choosing a group,
    hardware=h100, leaves the scenario's hardware.devices in force). With the composed cfg
    and the group choices, a key whose value in force is not the scenario's (a command's own
    config, composed after the scenario, replaced it) is left out too; [] for none."""
    settings = scenario_settings(name)
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    kept = [f"{k}={_format(v)}" for k, v in settings.items()
            if not any(k == g or (g not in groups and k.startswith(g + ".")) for g in given)
            and _in_force(k, v, cfg, choices or {}, groups)]
    if not kept:
        return []
    head = f"scenario {name}" + (f" (its title as written: {title})" if title else "") + \
        " sets, beyond the command line:"
    return textwrap.wrap(head, width=width, subsequent_indent="  ") + \
        textwrap.wrap(" ".join(kept), width=width, initial_indent="  ",
                      subsequent_indent="  ", break_on_hyphens=False)


def _in_force(key: str, value: Any, cfg: object | None, choices: dict[str, str],
              groups: set[str]) -> bool:
    """Whether the scenario's value of key is the one the composed config holds (True when
    there is no config to ask)."""
    if key in groups:
        return key not in choices or str(choices[key]) == str(value)
    if cfg is None:
        return True
    node: Any = cfg
    for part in key.split("."):
        if not hasattr(node, part):
            return True
        node = getattr(node, part)
    if isinstance(value, list):
        return isinstance(node, (list, tuple)) and [_format(v) for v in node] == \
            [_format(v) for v in value]
    return _format(node) == _format(value) or (
        isinstance(value, (int, float)) and isinstance(node, (int, float))
        and float(node) == float(value))


def setting_lines(cfg: SimConfig, first_row: dict | None = None,
                  width: int = TABLE_WIDTH) -> list[str]:
    """The setting (model, hardware, link, workload, acceptance, samples) and how to read the
    times below it, wrapped to width."""
    link, wl = cfg.link, cfg.workload
    setting = (f"setting: model={cfg.model.name} hardware={cfg.hardware.devices}x"
               f"{cfg.hardware.name} link={link.name} at {link.bandwidth_gbps:g} Gbps"
               + (" (trace)" if link.trace else "") + f" workload={wl.kind} "
               + (f"context={wl.context_tokens} output={wl.output_tokens}"
                  if wl.kind == "single" else
                  f"({(first_row or {}).get('requests', wl.requests)} requests)")
               + f" acceptance={cfg.speculative.acceptance} samples={cfg.samples}")
    prefill = (first_row or {}).get("prefill_s")
    reading = ("times: s from request arrival" + (f" (prefill {prefill:.3f} s)" if prefill
                                                   else "")
               + "; committed: a drafted token counts once verified; drafted: when drafted, "
               "as the seeds count" + ("; ±95%: half-width of the 95% interval of the mean"
                                       if cfg.samples > 1 else "")
               + f"; comm, deser: parts of the breakdown of TT{cfg.metrics.breakdown_k}T from "
               "prefill end")
    out = []
    for text in (setting, reading):
        out += textwrap.wrap(text, width=width, subsequent_indent="  ",
                             break_on_hyphens=False)
    return out


def setting_header(cfg: SimConfig, first_row: dict | None = None,
                   width: int = TABLE_WIDTH) -> list[str]:
    """What `kvsim sim` and `kvsim advise` print above their tables: what a named scenario
    carried over that the command line did not set, then the setting itself."""
    scenario, overrides, choices = hydra_run()
    return carried_over(scenario, cfg.title, overrides, cfg, choices, width) + \
        setting_lines(cfg, first_row, width)
