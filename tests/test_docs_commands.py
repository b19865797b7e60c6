"""Every ``hpctrain`` command in README.md and docs/ parses as written, and the cheap ones run.

The commands are taken from the fenced code blocks: a line that runs ``hpctrain`` (alone, or after
``mpiexec``/``mpirun``/``srun`` and their options) up to a ``#`` comment, ``&&``, ``;`` or ``|``. Each is
parsed by the command line's own parser, so a renamed option or subcommand in the code fails here
until the docs follow. Those that need no checkpoint, data or ranks (``config``, ``plan``, ``env``,
``--version``, ``--help``) are run from the repository root and must succeed (``plan`` may exit 1:
"does not fit" is its answer). Placeholders in capitals (CKPT, FILE) and paths of runs not made
here stay unchecked beyond parsing.
"""

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
CHEAP = {"config", "plan", "env", "--version", "--help"}
_FENCE = re.compile(r"^```")
# a command line: hpctrain first, or after a launcher and its options (output lines and prose do not match)
_COMMAND = re.compile(r"^((mpiexec|mpirun|srun)(\s+-{1,2}[\w-]+(\s+\d+)?)*\s+)?hpctrain\s")


def commands():
    """(file, line number, the argv after ``hpctrain``) of every hpctrain command in a fenced block."""
    found = []
    for path in FILES:
        inside = False
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if _FENCE.match(line.strip()):
                    inside = not inside
                    continue
                if not inside or "hpctrain" not in line:
                    continue
                text = re.split(r"\s(?:&&|;|\|)\s", line.strip().removeprefix("$ "))
                text = next((part for part in text if _COMMAND.match(part.strip())), None)
                if text is None or "$" in text or "..." in text or "[--" in text:
                    continue  # a variable, an elision, or a usage synopsis
                text = text.strip()
                try:
                    words = shlex.split(text, comments=True)
                except ValueError:
                    continue
                if "hpctrain" not in words:
                    continue
                argv = words[words.index("hpctrain") + 1:]
                if argv and re.fullmatch(r"-{0,2}[a-z][a-z0-9-]*", argv[0]):  # not output ("hpctrain CPU backend")
                    found.append((os.path.relpath(path, ROOT), number, argv))
    return found


ALL = commands()


def test_the_docs_hold_commands():
    assert len(ALL) >= 30, ALL  # the extraction found the docs' commands (a broken pattern would find none)
    assert {argv[0] for _, _, argv in ALL} >= {"train", "sample", "inspect", "plan", "config", "env", "data"}


@pytest.mark.parametrize("where, argv", [(f"{p}:{n}", a) for p, n, a in ALL], ids=[f"{p}:{n}" for p, n, _ in ALL])
def test_each_command_parses_as_written(where, argv):
    from hpctrain.commands.parser import parser as _parser

    try:
        _parser().parse_args(argv)
    except SystemExit as e:
        if e.code != 0 or argv[-1] not in ("--help", "-h", "--version"):
            pytest.fail(f"{where}: `hpctrain {' '.join(argv)}` does not parse")


CHEAP_ONES = [(f"{p}:{n}", a) for p, n, a in ALL if a[0] in CHEAP
              and all(os.path.exists(os.path.join(ROOT, w)) for w in a[1:2] if w.endswith(".toml"))]  # my.toml: a name


@pytest.mark.parametrize("where, argv", CHEAP_ONES, ids=[w for w, _ in CHEAP_ONES])
def test_each_cheap_command_runs(where, argv):
    proc = subprocess.run([sys.executable, "-m", "hpctrain", *argv], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    ok = (0, 1) if argv[0] == "plan" else (0,)
    assert proc.returncode in ok, f"{where}: `hpctrain {' '.join(argv)}` exited {proc.returncode}: {proc.stderr[-800:]}"


def config_blocks():
    """(file, block) of every fenced TOML block in the docs that is a whole config (a [model] and a [data])."""
    import tomllib

    found = []
    for path in FILES:
        for block in re.findall(r"^```toml\n(.*?)^```", open(path).read(), re.S | re.M):
            table = tomllib.loads(block)
            if "model" in table and "data" in table:
                found.append((os.path.relpath(path, ROOT), table))
    return found


@pytest.mark.parametrize("where,table", config_blocks(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_whole_config_in_the_docs_is_valid(where, table):
    """A config a user copies from the docs (the user guide's nanoGPT recipe) passes the config's own checks."""
    from hpctrain.config import parse_config

    parse_config(table)


def test_the_docs_hold_a_whole_config():
    assert any(where == "docs/user-guide.md" for where, _ in config_blocks())
