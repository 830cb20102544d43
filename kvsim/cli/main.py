"""`kvsim` command line: one entry point, subcommands, each subcommand a Hydra application.

    kvsim <command> [<subcommand>] [key=value ...] [-m key=a,b ...] [report=PATH]
    kvsim sweep key=a,b ...        (a resumable multirun of `kvsim sim`, kvsim/cli/sweep.py)
    kvsim list [group]   kvsim --version

Each command lives in `kvsim/commands/<name>.py` and declares COMMAND (its words),
CONFIG_NAME (conf/<CONFIG_NAME>.yaml), a `Config` dataclass schema and `run(cfg) -> rows`;
optionally POSITIONAL, the config keys that bare words after the command fill in order
(`kvsim compare A.json B.json` with POSITIONAL = ("a", "b") is `a=A.json b=B.json`).
Everything after the command words is Hydra's command line: overrides, `-m/--multirun`,
`--cfg job`, `--info`, `--hydra-help`, `--shell-completion`, `hydra.run.dir=...`. Every run
gets Hydra's run directory (outputs/<date>/<time>-<command>/, or multirun/.../<job>/ under
-m; $KVSIM_OUTPUT_ROOT moves both) with .hydra/ (the composed config and overrides) and
report.json beside it. This is the only module that drives Hydra's application machinery:
commands receive their typed `Config`.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException

from kvsim.core.compose import from_resolved, register_schema
from kvsim.core.errors import UsageError
from kvsim.core.paths import CONF_DIR


class CommandFailed(CompactHydraException):
    """A user-facing error of a command run by Hydra: Hydra prints the message alone (no
    traceback) and exits 1; under -m the job is marked failed."""


@dataclass(frozen=True)
class CommandInfo:
    words: tuple[str, ...]
    help: str
    module: str  # imported only when the command runs (heavy dependencies: torch, transformers)
    config_name: str = ""

    @property
    def job_name(self) -> str:
        return "_".join(self.words)


def _commands() -> dict[tuple[str, ...], CommandInfo]:
    """Read COMMAND, HELP and CONFIG_NAME from each kvsim/commands/*.py without importing it,
    so `kvsim --help` stays instant."""
    import kvsim.commands as pkg

    found: dict[tuple[str, ...], CommandInfo] = {}
    for path in sorted(Path(pkg.__path__[0]).glob("*.py")):
        consts: dict[str, object] = {}
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name) and target.id in ("COMMAND", "HELP",
                                                                  "CONFIG_NAME"):
                    consts[target.id] = ast.literal_eval(node.value)
        if "COMMAND" in consts:
            words = tuple(consts["COMMAND"])  # type: ignore[arg-type]
            found[words] = CommandInfo(words, str(consts.get("HELP", "")),
                                       f"kvsim.commands.{path.stem}",
                                       str(consts.get("CONFIG_NAME", "")))
    return found


def _usage(commands: dict[tuple[str, ...], CommandInfo]) -> str:
    lines = [
        "usage: kvsim <command> [key=value ...] [-m key=a,b ...] [report=PATH]",
        "       kvsim list [group]      kvsim --version",
        "",
        "commands:",
    ]
    for words, info in sorted(commands.items()):
        lines.append(f"  {' '.join(words):<16} {info.help}")
    lines += [
        "",
        "Overrides are Hydra syntax (e.g. link.bandwidth_gbps=25 'codecs=[bf16,lynx]');",
        "-m runs every combination of comma-separated values (link.bandwidth_gbps=10,25,50).",
        "Each run writes report.json and .hydra/ into outputs/<date>/<time>-<command>/",
        "($KVSIM_OUTPUT_ROOT moves it; hydra.run.dir=DIR names it); report=PATH adds a copy.",
        "`kvsim <command> --help` shows the command's config, groups and every field's comment.",
    ]
    return "\n".join(lines)


def version_string() -> str:
    """`kvsim 0.1.0 (<git describe --always --dirty> of the checkout)`."""
    from kvsim.core.report import git_state
    from kvsim.core.version import VERSION

    described = git_state().get("git_describe") or ""
    return f"kvsim {VERSION}" + (f" ({described})" if described else "")


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:  # `kvsim ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("kvsim: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    commands = _commands()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage(commands))
        return 0
    if argv[0] in ("--version", "-V", "version"):
        print(version_string())
        return 0
    if argv[0] in ("-sc", "--shell-completion"):
        return _shell_completion(commands, argv[1:])
    if argv[0] == "list":
        from kvsim.cli.help import list_groups

        try:
            print(list_groups(argv[1:]))
        except ValueError as exc:
            print(f"kvsim list: {exc}", file=sys.stderr)
            return 2
        return 0
    words = []
    for a in argv:
        if "=" in a or a.startswith("-"):
            break
        words.append(a)
    match = max((w for w in commands if tuple(words[: len(w)]) == w), key=len, default=None)
    if match is None:
        from kvsim.cli.keys import closest

        hint = closest(" ".join(words), [" ".join(w) for w in commands])
        print(f"kvsim: unknown command {' '.join(words)!r}" + (f"; did you mean {hint!r}?"
              if hint else "") + f"\n\n{_usage(commands)}", file=sys.stderr)
        return 2
    info = commands[match]
    mod = importlib.import_module(info.module)
    rest = list(argv[len(match):])
    positional = tuple(getattr(mod, "POSITIONAL", ()))
    for i, key in enumerate(positional):  # `kvsim compare A.json B.json` -> a=A.json b=B.json
        if i < len(rest) and "=" not in rest[i] and not rest[i].startswith("-"):
            rest[i] = f"{key}={_quoted(rest[i])}"
    name = " ".join(match)
    resolved = [a for a in rest if a.startswith("--resolved=")]
    if resolved:  # a parent kvsim process hands its child the config it resolved
        reports = [a.split("=", 1)[1] for a in rest if a.startswith("report=")]
        return _run_resolved(name, mod, resolved[0].split("=", 1)[1],
                             reports[-1] if reports else None)
    if getattr(mod, "MULTIRUN_OF", None):  # `kvsim sweep`: a multirun of another command
        target = next(i for w, i in commands.items() if w == tuple(mod.MULTIRUN_OF))
        if any(a in ("-h", "--help") for a in rest):
            from kvsim.cli.help import command_help

            print(f"kvsim {name}: {dedent_doc(mod)}\n\n(the options are `kvsim "
                  f"{' '.join(target.words)}`'s, below)\n")
            target_mod = importlib.import_module(target.module)
            print(command_help(" ".join(target.words), target_mod,
                               [a for a in rest if "=" in a and not a.startswith("-")]))
            return 0
        try:
            rest = mod.multirun_arguments(rest)
        except (ValueError, UsageError) as exc:
            print(f"kvsim {name}: {exc}", file=sys.stderr)
            return 2
        name, info = " ".join(target.words), target
        mod = importlib.import_module(target.module)
    return _run_hydra_app(name, info, mod, rest)


def _quoted(value: str) -> str:
    """A bare command-line word as a Hydra string value (quoted: paths hold `/`, `:` ...)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _shell_completion(commands: dict[tuple[str, ...], CommandInfo], args: list[str]) -> int:
    """`eval "$(kvsim --shell-completion install=bash)"` installs Hydra's completion for
    `kvsim`; the script then calls `kvsim -sc query=bash` with COMP_LINE set, which completes
    the command words here and hands the rest of the line to that command's Hydra app."""
    line = os.environ.get("COMP_LINE", "")
    if not any(a.startswith("query=") for a in args):  # install= / uninstall=
        info = commands[("sim",)]
        mod = importlib.import_module(info.module)
        return _launch("sim", info, mod, ["--shell-completion", *args], None, prog="kvsim")
    words = line.split()
    typed = words[1:]
    match = max((w for w in commands if tuple(typed[: len(w)]) == w), key=len, default=None)
    if match is None or (len(typed) == len(match) and not line.endswith(" ")):
        prefix = " ".join(typed)
        print("\n".join(sorted({" ".join(w)[len(prefix) - len(typed[-1]):].split(" ")[0]
                                 if typed else w[0]
                                 for w in commands if " ".join(w).startswith(prefix)})))
        return 0
    info = commands[match]
    mod = importlib.import_module(info.module)
    cut = line.index(match[-1], len(words[0])) + len(match[-1])
    os.environ["COMP_LINE"] = "kvsim" + line[cut:]
    point = int(os.environ.get("COMP_POINT", len(line)))
    os.environ["COMP_POINT"] = str(max(len("kvsim"), point - cut + len("kvsim")))
    return _launch(" ".join(match), info, mod, ["--shell-completion", *args], None,
                   prog="kvsim")


def _run_resolved(name: str, mod: Any, path: str, report_path: str | None = None) -> int:
    """Run a command on a config another kvsim process resolved (its child: `kvsim emulate`
    starts `serve` / `send` so); report_path: where the child writes its report (rows)."""
    try:
        cfg, plain = from_resolved(path, mod.Config)
    except Exception as exc:  # OmegaConf validation of a config another process wrote
        print(f"kvsim {name}: bad resolved configuration {path}: {exc}", file=sys.stderr)
        return 2
    started = time.time()
    try:
        rows = mod.run(cfg)
    except (ValueError, FileNotFoundError, UsageError, TimeoutError) as exc:
        print(f"kvsim {name}: error: {exc}", file=sys.stderr)
        return 1
    extra = {}
    if isinstance(rows, dict):  # {"rows": [...], other top-level report keys}
        extra = {k: v for k, v in rows.items() if k != "rows"}
        rows = rows["rows"]
    if report_path:
        from kvsim.core.report import write_report

        write_report(report_path, name, plain, rows or [], time.time() - started,
                     [f"--resolved={path}"], extra)
    if extra.get("failed"):  # the run ended, its report says what happened, and it failed
        print(f"kvsim {name}: failed: {extra['failed']}", file=sys.stderr)
        return 1
    return 0


def _run_hydra_app(name: str, info: CommandInfo, mod: Any, rest: list[str]) -> int:
    """Hand `rest` to Hydra as the command line of an application whose config is
    conf/<CONFIG_NAME>.yaml and whose task runs the command."""
    from hydra._internal.utils import get_args_parser

    report_path = None
    args: list[str] = []
    for arg in rest:
        if arg.startswith("report="):
            report_path = arg.split("=", 1)[1]
        else:
            args.append(arg)
    parser = get_args_parser()
    parser.prog = f"kvsim {name}"
    try:  # flags and overrides in any order (Hydra's own parser wants flags first)
        parsed = parser.parse_intermixed_args(args)
    except SystemExit as exc:  # argparse printed its usage error
        return int(exc.code or 2)
    for flag in ("config_path", "config_name", "experimental_rerun"):
        if getattr(parsed, flag) is not None:
            print(f"kvsim {name}: --{flag.replace('_', '-')} is not offered: the command "
                  f"names its config (conf/{info.config_name}.yaml); use --config-dir DIR "
                  "to add a directory of presets", file=sys.stderr)
            return 2
    if parsed.help:
        from kvsim.cli.help import command_help

        try:
            print(command_help(name, mod, parsed.overrides))
        except ValueError as exc:
            print(f"kvsim {name}: {exc}", file=sys.stderr)
            return 2
        return 0
    if report_path is not None and parsed.multirun:
        print(f"kvsim {name}: report= names one file, but -m runs several jobs; each job "
              "writes report.json in its own directory under multirun/", file=sys.stderr)
        return 2
    from kvsim.cli.keys import OverrideError, check_overrides

    schema = getattr(mod, "Config", None)
    overrides = list(parsed.overrides)
    try:
        if not parsed.shell_completion:  # its arguments (install=bash) are not overrides
            overrides = check_overrides(info.config_name, schema, overrides)
    except OverrideError as exc:
        print(f"kvsim {name}: {exc}", file=sys.stderr)
        return 2
    hydra_args = _hydra_flags(parsed) + overrides + \
        _default_hydra_overrides(info, overrides)
    return _launch(name, info, mod, hydra_args, report_path)


def _hydra_flags(parsed: Any) -> list[str]:
    """The flags of a parsed Hydra command line, rebuilt in the order Hydra's parser wants
    (before the overrides)."""
    flags: list[str] = []
    for attr, flag in (("multirun", "--multirun"), ("run", "--run"), ("resolve", "--resolve"),
                       ("shell_completion", "--shell-completion"),
                       ("hydra_help", "--hydra-help")):
        if getattr(parsed, attr):
            flags.append(flag)
    for attr, flag in (("cfg", "--cfg"), ("package", "--package"), ("info", "--info"),
                       ("config_dir", "--config-dir")):
        value = getattr(parsed, attr)
        if value is not None:
            flags += [flag, str(value)]
    return flags


def _default_hydra_overrides(info: CommandInfo, overrides: list[str]) -> list[str]:
    """Where runs go (unless the command line says): $KVSIM_OUTPUT_ROOT (default: the
    current directory)/outputs/<date>/<time>-<command>, multirun/<date>/<time>-<command>/N."""
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    root = "${oc.env:KVSIM_OUTPUT_ROOT,.}"
    stamp = "${now:%Y-%m-%d}/${now:%H-%M-%S}-" + info.job_name
    defaults = {
        "hydra.job.name": info.job_name,
        "hydra.run.dir": f"{root}/outputs/{stamp}",
        "hydra.sweep.dir": f"{root}/multirun/{stamp}",
    }
    return [f"{k}='{v}'" for k, v in defaults.items() if k not in given]


def _launch(name: str, info: CommandInfo, mod: Any, hydra_args: list[str],
            report_path: str | None, prog: str | None = None) -> int:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    register_schema(info.config_name, getattr(mod, "Config", None))
    task = _task(name, mod, report_path)
    app = hydra.main(version_base="1.3", config_path=str(CONF_DIR),
                     config_name=info.config_name)(task)
    saved_argv = sys.argv
    sys.argv = [prog or f"kvsim {name}", *hydra_args]
    try:
        app()
    except SystemExit as exc:  # Hydra reports composition / job errors, then exits
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved_argv
        HydraConfig.instance().cfg = None  # a later in-process call is not inside this run
    return 0


def _remove_if_empty(run_dir: Path) -> None:
    """A run that failed before writing anything leaves no directory: only Hydra's own
    `.hydra/` and an empty log are there (its parent too, when that is left empty)."""
    import shutil

    try:
        entries = list(run_dir.iterdir())
    except OSError:
        return
    if all(e.name == ".hydra" or (e.suffix == ".log" and e.stat().st_size == 0)
           for e in entries):
        shutil.rmtree(run_dir, ignore_errors=True)
        try:
            run_dir.parent.rmdir()  # outputs/<date>/ holding nothing else
        except OSError:
            pass


def _task(name: str, mod: Any, report_path: str | None):
    """The Hydra task: typed config -> mod.run -> report.json in the run directory."""
    def task(dcfg: Any) -> list[dict]:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
        from omegaconf import OmegaConf

        from kvsim.core.paths import output_dir
        from kvsim.core.report import write_report

        hc = HydraConfig.get()
        overrides = list(hc.overrides.task)
        where = f" (job {hc.job.num}: {' '.join(overrides)})" \
            if hc.mode == RunMode.MULTIRUN else ""
        plain = OmegaConf.to_container(dcfg, resolve=True)
        try:  # the schema's own checks (__post_init__) run here
            typed = OmegaConf.to_object(dcfg) if getattr(mod, "Config", None) else plain
        except Exception as exc:  # OmegaConf validation / ValueError of a dataclass check
            msg = str(exc.__cause__ or exc).strip().splitlines()[0]
            raise CommandFailed(f"kvsim {name}: bad configuration{where}: {msg}") from None
        in_sweep = hc.mode == RunMode.MULTIRUN and \
            str(hc.sweeper.get("_target_", "")).endswith("ResumingSweeper")
        if hc.mode == RunMode.RUN and hc.sweeper.get("params"):
            grid = " ".join(f"{k}={v}" for k, v in hc.sweeper.params.items())
            print(f"kvsim {name}: this configuration declares a grid ({grid}); this run is one "
                  "point of it, add -m to run them all", file=sys.stderr)
        started = time.time()
        try:
            if in_sweep:
                from kvsim.cli.sweep import run_point

                rows = run_point(mod.run, typed, plain, overrides, name)
            else:
                rows = mod.run(typed)
        except (ValueError, FileNotFoundError, UsageError, TimeoutError) as exc:
            if hc.mode == RunMode.RUN:
                _remove_if_empty(output_dir())
            raise CommandFailed(f"kvsim {name}: error{where}: {exc}") from None
        wall_s = time.time() - started
        extra = {}
        if isinstance(rows, dict):  # {"rows": [...], other top-level report keys}
            extra = {k: v for k, v in rows.items() if k != "rows"}
            rows = rows["rows"]
        run_dir = output_dir()
        write_report(run_dir / "report.json", name, plain, rows or [], wall_s, overrides, extra)
        if report_path:
            write_report(report_path, name, plain, rows or [], wall_s, overrides, extra)
            print(f"report written to {report_path}", file=sys.stderr)
        if extra.get("failed"):  # the report is written; the command still fails (exit 1)
            raise CommandFailed(f"kvsim {name}: failed{where}: {extra['failed']}")
        return rows or []

    # what a job's process loads before its first run (the command's module and its
    # prepare(), if any): a sweep's worker processes do it while the sweep's parent prepares
    task.prepare = (mod.__name__, "prepare" if hasattr(mod, "prepare") else None)  # type: ignore[attr-defined]
    return task


def dedent_doc(mod: Any) -> str:
    return textwrap.dedent(mod.__doc__ or getattr(mod, "HELP", "")).strip()


if __name__ == "__main__":
    raise SystemExit(main())
