"""Every `skylift train` / `skylift eval` command the docs show passes `--dry-run` (issue 42, item 7):
the configuration check a real run does first, so a copied command is never refused for its keys.

Commands are found in the fenced code blocks of README.md and docs/*.md:
- shell lines whose first word (after `$ ` and `VAR=value` prefixes) is `skylift` and whose
  subcommand is `train` or `eval` (the commands with `--dry-run`), `\\` continuations joined;
- Python launchers: a call `main([...])` whose list of string literals starts with "train" or
  "eval" (`skylift.cli.main`).

Each runs as `skylift.cli.main([subcommand, "--dry-run", *args])` in this process, from the
repository root (relative `--config` paths), with its `VAR=value` prefixes in the environment.

Substitution rule (what the reader replaces, the test replaces; nothing else is changed: a dry run
reads no data, model or server, so data paths, URLs and model names stand as written):
- a lone `...` ("more options") is dropped;
- `--checkpoint PATH` where PATH does not exist: a complete trainer checkpoint of the same name
  (`global_step_N`, its policy/ without weights) made in a temporary directory;
- `trainer.algorithm.import_modules=[NAME, ...]`: each NAME the docs show as a Python block that
  opens with `# NAME.py` is written to a temporary directory, and the command runs in a fresh
  Python process started there (the docs say the modules are found in the directory the command
  starts from; a process of its own, since importing registers names for the whole process).
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from skylift.cli import main
from skylift.rl import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_COMMANDS = ("train", "eval")

_FENCE = re.compile(r"^[ \t]*```([^\n]*)\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")

#: Lines of code blocks that start with `skylift train` but are not commands (each must still be
#: on its page, so the list cannot go stale): page -> the line's text.
NOT_COMMANDS = {
    "agentic.md": "skylift train (environment.verifiers.address)  ------------+",  # a diagram
}


@dataclass(frozen=True)
class DocCommand:
    page: str
    line: int
    argv: tuple[str, ...]  # from the subcommand on, `--dry-run` not added yet
    env: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {' '.join(self.argv)}"


def _shell_commands(page: str, start_line: int, block: str) -> tuple[list[DocCommand], list[str]]:
    commands, skipped = [], []
    logical: list[tuple[int, str]] = []
    for offset, raw in enumerate(block.splitlines()):
        if logical and logical[-1][1].endswith("\\"):
            logical[-1] = (logical[-1][0], logical[-1][1][:-1] + " " + raw.strip())
        else:
            logical.append((start_line + offset, raw.strip()))
    for line_no, text in logical:
        text = text.removeprefix("$ ")
        words = text.split()
        env_words = 0
        while env_words < len(words) and _ENV.match(words[env_words]):
            env_words += 1
        if words[env_words : env_words + 1] != ["skylift"] or len(words) <= env_words + 1:
            continue
        if words[env_words + 1] not in RUN_COMMANDS:
            continue
        if NOT_COMMANDS.get(page) == text:
            skipped.append(text)
            continue
        tokens = shlex.split(text.split(" #", 1)[0])
        env = tuple(tuple(t.split("=", 1)) for t in tokens[:env_words])
        argv = tuple(t for t in tokens[env_words + 1 :] if t != "...")
        commands.append(DocCommand(page, line_no, argv, env))  # type: ignore[arg-type]
    return commands, skipped


def _python_commands(page: str, start_line: int, block: str) -> list[DocCommand]:
    commands = []
    for node in ast.walk(ast.parse(block)):
        if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.List)):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        items = node.args[0].elts
        if name != "main" or not all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in items):
            continue
        argv = tuple(e.value for e in items)  # type: ignore[attr-defined]
        if argv[:1] and argv[0] in RUN_COMMANDS:
            commands.append(DocCommand(page, start_line + node.lineno - 1, argv, ()))
    return commands


def doc_commands() -> tuple[list[DocCommand], list[tuple[str, str]], dict[str, str]]:
    """Every run command of the docs' code blocks, the `NOT_COMMANDS` lines met and the modules
    the docs show (`# NAME.py` blocks: name -> source)."""
    commands: list[DocCommand] = []
    skipped: list[tuple[str, str]] = []
    modules: dict[str, str] = {}
    for path in PAGES:
        text = path.read_text(encoding="utf-8")
        for match in _FENCE.finditer(text):
            language = match.group(1).strip().lower()
            start = text.count("\n", 0, match.start(2)) + 1
            if language == "python":
                source = textwrap.dedent(match.group(2))
                named = re.match(r"# (\w+)\.py\b", source)
                if named:
                    modules[named.group(1)] = source
                commands += _python_commands(path.name, start, source)
            else:
                found, seen = _shell_commands(path.name, start, match.group(2))
                commands += found
                skipped += [(path.name, s) for s in seen]
    return commands, skipped, modules


COMMANDS, SKIPPED, MODULES = doc_commands()


def test_the_docs_show_run_commands_and_each_skipped_line_is_still_there() -> None:
    pages = {c.page for c in COMMANDS}
    assert {"README.md", "trainer.md", "agentic.md", "coming_from_skyrl.md", "multihost.md"} <= pages
    assert any(c.argv[0] == "eval" for c in COMMANDS)
    assert any(c.page == "agentic.md" and "environment.env_class=calculator" in c.argv for c in COMMANDS)
    assert sorted(SKIPPED) == sorted(NOT_COMMANDS.items()), "a NOT_COMMANDS line left its page: drop it"


def test_extraction_joins_continuations_reads_env_prefixes_and_python_launchers() -> None:
    block = "X=1 skylift train a=1 \\\n  b=\"['~/p']\" ...  # comment\n$ skylift eval c=2\nskylift serve --model m\n"
    found, _ = _shell_commands("p.md", 10, block)
    assert [(c.line, c.argv, c.env) for c in found] == [
        (10, ("train", "a=1", "b=['~/p']"), (("X", "1"),)),
        (12, ("eval", "c=2"), ()),
    ]
    launcher = 'import sys\nfrom skylift.cli import main\n\nsys.exit(main(["train", "k=v"]))\n'
    assert [(c.line, c.argv) for c in _python_commands("p.md", 5, launcher)] == [(8, ("train", "k=v"))]


def _substituted(command: DocCommand, tmp_path: Path) -> tuple[list[str], list[str]]:
    """The command's arguments after the substitution rule, and the modules it needs written."""
    argv = list(command.argv)
    for i, word in enumerate(argv[:-1]):
        if word == "--checkpoint" and not Path(argv[i + 1]).expanduser().exists():
            step = int(re.fullmatch(r"global_step_(\d+)", Path(argv[i + 1]).name).group(1))  # type: ignore[union-attr]
            made = ckpt.begin_checkpoint(tmp_path / "ckpts", step)
            (made / "policy").mkdir()
            argv[i + 1] = str(
                ckpt.commit_checkpoint(
                    tmp_path / "ckpts", step, ckpt.TrainerState(global_step=step, policy_version=step)
                )
            )
    modules: list[str] = []
    for word in argv:
        if word.startswith("trainer.algorithm.import_modules="):
            modules += [m.strip() for m in word.split("=", 1)[1].strip("[]").split(",") if m.strip()]
    return argv, modules


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_a_docs_command_passes_its_dry_run(
    command: DocCommand, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, modules = _substituted(command, tmp_path)
    dry_run = [argv[0], "--dry-run", *argv[1:]]
    if modules:
        for name in modules:
            assert name in MODULES, f"{command}: the docs import {name!r} but show no `# {name}.py` block"
            (tmp_path / f"{name}.py").write_text(MODULES[name], encoding="utf-8")
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from skylift.cli import main; sys.exit(main(sys.argv[1:]))",
                *dry_run,
            ],
            cwd=tmp_path,
            env={**os.environ, **dict(command.env)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        code, err = done.returncode, done.stderr
    else:
        monkeypatch.chdir(ROOT)
        for key, value in command.env:
            monkeypatch.setenv(key, value)
        code = main(dry_run)
        err = capsys.readouterr().err
    assert code == 0, f"{command}\n{err[-2000:]}"
    assert "dry run: the configuration is valid" in err
