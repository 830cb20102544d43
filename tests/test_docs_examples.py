"""Every command example of README.md and docs/ runs, and prints what the page says it prints.

An example is a fenced `console` block whose commands start with `$ kvsim`:

    <!-- example: slow -->
    ```console
    $ kvsim sim 'codecs=[int8,lynx]' samples=4
    ...
    int8     monolithic  16384    10  2.282   5.252 ...
    ...
    ```

- A command line starts with `$ `; a line ending in ` \\` continues on the next line. Words
  are split as a POSIX shell would (`shlex`, `#` starts a comment); `kvsim` becomes
  `sys.executable -m kvsim`, so the example runs on the interpreter of the test. A command
  ending in ` &` runs in the background (e.g. `kvsim serve`): the block's next commands run
  beside it, and it must exit 0 by the end of the block.
- The lines after a command, up to the next `$ ` line, are its expected standard output,
  compared as doctest compares (ELLIPSIS, NORMALIZE_WHITESPACE): `...` stands for any text,
  a line of its own for any number of lines. Lines that are not shown are not checked;
  a command with no lines after it is checked for its exit status only.
- Every command must exit 0. The commands of one block share one working directory (a
  fresh temporary directory holding a `data` link to the repository's data/, so paths read
  as from the repository root) and one KVSIM_OUTPUT_ROOT (another temporary directory).
  Nothing may change in the repository.
- An HTML comment right above the block marks it: `<!-- example: slow -->` (longer than
  ~20 s), `net` (root and network namespaces; skipped without them), `gpu` (CUDA).
  Markers combine with commas.

Blocks of other languages (```sh, ```text) are not run. Examples that need the real model
need `kvsim model fetch` first, which `make test` runs before pytest.
"""

from __future__ import annotations

import doctest
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
MARKERS = {"slow", "net", "gpu"}
COMMAND_TIMEOUT_S = 600
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
_MARK = re.compile(r"^\s*<!--\s*example:\s*(?P<marks>[\w ,-]+?)\s*-->\s*$")
_CHECKER = doctest.OutputChecker()
_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@dataclass
class Command:
    line: int  # 1-based line of its `$ ` in the file
    text: str  # as written, continuation lines joined
    expected: list[str] = field(default_factory=list)

    @property
    def background(self) -> bool:
        return self.text.rstrip().endswith("&")

    def argv(self) -> list[str]:
        words = shlex.split(self.text.rstrip().removesuffix("&"), comments=True)
        if not words or words[0] != "kvsim":
            raise ValueError(f"line {self.line}: an example runs `kvsim ...` only: {self.text}")
        return [sys.executable, "-m", "kvsim", *words[1:]]


@dataclass
class Example:
    path: Path
    line: int  # 1-based line of the opening fence
    marks: set[str]
    commands: list[Command]

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def _commands(body: list[tuple[int, str]]) -> list[Command]:
    commands: list[Command] = []
    for number, text in body:
        if commands and commands[-1].text.endswith("\\") and not commands[-1].expected:
            commands[-1].text = commands[-1].text[:-1].rstrip() + " " + text.strip()
        elif text.startswith("$ "):
            commands.append(Command(number, text[2:].strip()))
        elif commands:
            commands[-1].expected.append(text)
    return commands


def collect(path: Path) -> list[Example]:
    """The console blocks of one Markdown file whose commands are `kvsim` commands."""
    lines = path.read_text().splitlines()
    examples = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m["indent"]), m["fence"], m["lang"]
        start = i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append((i + 1, lines[i][indent:]))
            i += 1
        i += 1
        if lang != "console":
            continue
        commands = _commands(body)
        if not commands:
            continue
        if not all(c.text.split()[0] == "kvsim" for c in commands):
            raise ValueError(f"{path}:{start + 1}: a console block mixes kvsim and other "
                             "commands; show the others in a ```sh block")
        marks: set[str] = set()
        if start > 0 and (mark := _MARK.match(lines[start - 1])):
            marks = {w.strip() for w in mark["marks"].split(",") if w.strip()}
            if unknown := marks - MARKERS:
                raise ValueError(f"{path}:{start}: unknown example marker(s) {sorted(unknown)}")
        examples.append(Example(path, start + 1, marks, commands))
    return examples


EXAMPLES = [e for f in DOC_FILES if f.is_file() for e in collect(f)]


def _params():
    for example in EXAMPLES:
        marks = [getattr(pytest.mark, m) for m in sorted(example.marks)]
        yield pytest.param(example, id=example.id, marks=marks)


def _need_net() -> None:
    from kvsim.transport.netns import netns_available

    ok, why = netns_available()
    if not ok:
        pytest.skip(f"needs network namespaces: {why}")


# where a command could write into the repository: what it reads (data/, conf/), what it
# ships (plots/), and the run directories it would make in a working directory there
_GUARDED = ["data", "conf", "scenarios", "plots", "outputs", "multirun", "results"]


def _repo_state() -> str:
    """What git sees in the repository's guarded paths, ignored files included (to prove an
    example wrote nothing there; edits elsewhere while the tests run do not count)."""
    out = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all",
                          "--", *_GUARDED], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"git status failed: {out.stderr}"
    return out.stdout


def _check(command: Command, proc_rc: int, stdout: str, stderr: str) -> None:
    where = f"line {command.line}: $ {command.text}"
    assert proc_rc == 0, (f"{where}\nexit status {proc_rc}\n--- stdout\n{stdout}\n"
                          f"--- stderr\n{stderr}")
    if not command.expected:
        return
    want = "\n".join(command.expected) + "\n"
    if not _CHECKER.check_output(want, stdout, _FLAGS):
        diff = _CHECKER.output_difference(doctest.Example("", want), stdout, _FLAGS)
        pytest.fail(f"{where}\n{diff}")


@pytest.mark.parametrize("example", _params())
def test_example(example: Example, tmp_path: Path) -> None:
    if "net" in example.marks:
        _need_net()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "data").symlink_to(REPO / "data", target_is_directory=True)
    env = dict(os.environ, KVSIM_OUTPUT_ROOT=str(tmp_path / "runs"), COLUMNS="200")
    before = _repo_state()
    background: list[tuple[Command, subprocess.Popen]] = []
    try:
        for command in example.commands:
            if command.background:
                proc = subprocess.Popen(command.argv(), cwd=cwd, env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                background.append((command, proc))
                continue
            done = subprocess.run(command.argv(), cwd=cwd, env=env, capture_output=True,
                                  text=True, timeout=COMMAND_TIMEOUT_S)
            _check(command, done.returncode, done.stdout, done.stderr)
        for command, proc in background:
            stdout, stderr = proc.communicate(timeout=COMMAND_TIMEOUT_S)
            _check(command, proc.returncode, stdout, stderr)
    finally:
        for _, proc in background:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert _repo_state() == before, "an example changed files in the repository"


def test_every_command_has_an_example() -> None:
    """Each `kvsim` command that `kvsim --help` lists is run by at least one example."""
    out = subprocess.run([sys.executable, "-m", "kvsim", "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    listed = out.split("commands:", 1)[1].split("\n\n", 1)[0]
    # "  bench codecs     codec bits/element ..." -> "bench codecs": words before the help text
    commands = {re.split(r"\s{2,}", line.strip())[0] for line in listed.splitlines()
                if line.strip()}
    shown = [" ".join(c.text.split()[1:]) + " " for e in EXAMPLES for c in e.commands]
    missing = sorted(c for c in commands if not any(s.startswith(c + " ") for s in shown))
    assert not missing, f"commands without a docs example: {missing}"


def test_collector_reads_blocks(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "<!-- example: slow, net -->",
        "```console",
        "$ kvsim sim 'codecs=[int8]' \\",
        "    samples=2   # a comment",
        "int8 ...",
        "...",
        "$ kvsim serve transport.max_requests=1 &",
        "```",
        "```sh",
        "$ kvsim not-run",
        "```",
        "```console",
        "$ make test",
        "```",
    ]))
    with pytest.raises(ValueError, match="mixes"):
        collect(page)
    page.write_text(page.read_text().rsplit("```console", 1)[0])
    (example,) = collect(page)
    assert example.line == 2 and example.marks == {"slow", "net"}
    first, second = example.commands
    assert first.argv()[3:] == ["sim", "codecs=[int8]", "samples=2"]
    assert first.expected == ["int8 ...", "..."] and not first.background
    assert second.background and second.argv()[3:] == ["serve", "transport.max_requests=1"]
