"""Extract the key=value overrides of SkyRL's example training commands into a text fixture.

    python scripts/skyrl_example_overrides.py GIT_DIR REF EXAMPLES_DIR > tests/unit/data/skyrl_commands_X.txt

reads every ``*.sh`` under ``EXAMPLES_DIR`` at ``REF`` of a SkyRL checkout (``git show``, no work
tree needed), expands the shell variables the script itself assigns (``X=1``, ``export X=1``,
``: "${X:=1}"``, ``${X:-1}``; ``$HOME`` is ``/home/user``, an unset one is empty as in the shell), and writes
one block per command that passes dotted overrides to a Python entry point (``main_sft``: every
``key=value``, its keys being flat)::

    # examples/train/gsm8k/run_gsm8k.sh:1 skyrl.train.entrypoints.main_base
    trainer.strategy=fsdp
    ...

Only the overrides are stored, never the scripts.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

_ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_]\w*)=(.*)$")
_DEFAULT = re.compile(r'^\s*:\s*"?\$\{([A-Za-z_]\w*):?=(.*)\}"?\s*(#[^}]*)?$')
_VAR = re.compile(r"\$\{([A-Za-z_]\w*)(?::?[-=]([^}]*))?\}|\$([A-Za-z_]\w*)")
_ARITH = re.compile(r"^\$\(\((.*)\)\)\s*(#.*)?$")
_INLINE_ARITH = re.compile(r"\$\(\(([\d\s+*/()-]+)\)\)")
_OVERRIDE = re.compile(r"^\+{0,2}[a-z_][\w]*(\.[\w\-]+)+=")
_SFT_OVERRIDE = re.compile(r"^\+{0,2}[a-z_][\w]*(\.[\w\-]+)*=")


def _expand(text: str, env: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        if name in env:
            return env[name]
        if m.group(2) is not None:
            return _expand(m.group(2), env)
        return ""  # unset: empty, as in the shell

    for _ in range(3):
        text = _VAR.sub(sub, text)
    return _INLINE_ARITH.sub(lambda m: str(eval(m.group(1), {"__builtins__": {}})), text)


def _unquote(value: str) -> str:
    try:
        parts = shlex.split(value, comments=True)
    except ValueError:
        return value.strip()
    return parts[0] if parts else ""


def _value(raw: str, env: dict[str, str]) -> str | None:
    """The value of a shell assignment's right side: one word, or ``$((integer arithmetic))``."""
    if m := _ARITH.match(raw):
        expr = re.sub(
            r"\b([A-Za-z_]\w*)\b", lambda v: env.get(v.group(1), v.group(1)), _expand(m.group(1), env)
        )
        return str(eval(expr, {"__builtins__": {}})) if re.fullmatch(r"[\d\s+*/()-]+", expr) else None
    try:
        parts = shlex.split(raw, comments=True)
    except ValueError:
        return None
    return _expand(parts[0], env) if len(parts) == 1 else "" if not parts else None


def commands(script: str) -> list[tuple[str, list[str]]]:
    """The entry point and override list of each Python command in one shell script."""
    env = {"HOME": "/home/user"}
    joined = re.sub(r"\\\n", " ", script)
    out: list[list[str]] = []
    for line in joined.splitlines():
        if m := _DEFAULT.match(line):
            value = _value(m.group(2), env) if m.group(2).startswith("$((") else None
            env.setdefault(m.group(1), value if value is not None else _expand(_unquote(m.group(2)), env))
            continue
        if m := _ASSIGN.match(line):
            value = _value(m.group(2), env)
            if value is not None:
                env[m.group(1)] = value
                continue
        if not re.search(r"(\bpython[\d.]*\b|\buv run\b|-m\s+\S+main)", line):
            continue
        try:
            tokens = shlex.split(_expand(line, env), comments=True)
        except ValueError:
            continue
        if _entry_point(tokens).endswith("main_sft"):  # SFT's keys are flat: every key=value
            out.append((_entry_point(tokens), [t for t in tokens if _SFT_OVERRIDE.match(t)]))
            continue
        overrides = [t for t in tokens if _OVERRIDE.match(t)]
        if any(o.lstrip("+").startswith(("trainer.", "generator.")) for o in overrides):
            out.append((_entry_point(tokens), overrides))
    return out


def _entry_point(tokens: list[str]) -> str:
    """The module after ``-m``, or the first ``*.py`` argument."""
    for i, token in enumerate(tokens[:-1]):
        if token == "-m":
            return tokens[i + 1]
    return next((t for t in tokens if t.endswith(".py")), "?")


def main(git_dir: str, ref: str, examples: str) -> None:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "--git-dir", git_dir, *args], check=True, capture_output=True, text=True
        ).stdout

    paths = [p for p in git("ls-tree", "-r", "--name-only", ref, examples).splitlines() if p.endswith(".sh")]
    for path in sorted(paths):
        for i, (entry, overrides) in enumerate(commands(git("show", f"{ref}:{path}")), 1):
            print(f"# {path}:{i} {entry}")
            print("\n".join(overrides))
            print()


if __name__ == "__main__":
    main(*sys.argv[1:4])
