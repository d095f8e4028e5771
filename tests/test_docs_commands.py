"""Every command the README and docs/*.md show still composes against today's code.

Each `python train.py ...` and `python -m <module> ...` line (code blocks and inline code) is read as a user
would type it and checked without running its task, in this process (a subprocess per command would cost
seconds of imports each): a Hydra command gets `--cfg job` (Hydra composes and prints the config: the recipe and
every group exist, every key exists), an argparse command's `--flags` must be in its `--help`, and the project
files it names must exist.
Placeholders (`<model>`, `...`, `[optional ...]`) stand for any value. docs/history/ keeps commands as they ran
then, and is not checked.
"""

import contextlib
import functools
import importlib.util
import io
import os
import re
import runpy
import shlex
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXTERNAL = {"pytest", "pip", "venv", "sglang.launch_server"}  # modules of other projects, not checked
PLACEHOLDER = "PLACEHOLDER"
# Values read as shipped project files when they start with one of these (outputs and a user's files are not).
PROJECT_FILES = ("models/", "data/sharegpt-smollm2", "conf/", "tests/")
OUTPUT_KEYS = {"out", "hydra.run.dir", "data.cache_dir", "runs"}

# Commands the docs have right that today's code refuses: (module, key) -> why. Each is a bug to fix in the code;
# strict, so the entry must go once the command runs.
KNOWN_BROKEN = {
    ("benchmarks.memory_plan", "quant"): "conf/benchmarks/quant (the serving commands' group) makes Hydra read "
                                         "memory_plan's string key quant= as a group override",
}

START = re.compile(r"(?:^|\s)(python3? (?:train\.py|-m [\w.]+)(?:\s|$).*)", re.S)


def _commands_in(text: str):
    """(line number, command) for each command in code blocks (indented, `\\` continued) and inline code."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("    ") and (match := START.search(line)):
            first, command = i, match.group(1)
            while command.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command.rstrip()[:-1] + " " + lines[i].strip()
            yield first + 1, command
        i += 1
    prose = re.sub(r"^    .*$", "", text, flags=re.M)  # code blocks done above; inline code may span lines
    for span in re.finditer(r"`([^`]+)`", prose):
        if match := START.search(span.group(1)):
            yield prose.count("\n", 0, span.start()) + 1, " ".join(match.group(1).split())


def _all_commands():
    for doc in DOCS:
        for line, command in _commands_in(doc.read_text()):
            words = command.split()
            broken = [why for (module, key), why in KNOWN_BROKEN.items()
                      if module in words[:3] and any(w.startswith(f"{key}=") for w in words)]
            marks = [pytest.mark.xfail(reason=broken[0], strict=True)] if broken else []
            yield pytest.param(command, id=f"{doc.relative_to(ROOT)}:{line}", marks=marks)


def _arguments(command: str) -> list[str]:
    """The command's arguments as the shell splits them, placeholders replaced and optional brackets opened."""
    command = re.sub(r"<[^<>]*>", PLACEHOLDER, command)
    command = re.sub(r"(?<![\w/])\.\.\.(?![\w/])", PLACEHOLDER, command)
    words = shlex.split(command, comments=True)
    if "|" in words:  # a pipe: the command is what comes before it
        words = words[: words.index("|")]
    arguments = []
    for word in words:
        if word.startswith("[") and ("=" in word or word.startswith("[-")):
            word = word[1:]  # `[batch_size=4 ... out=plan.json]`, `[--target DIR]`: optional arguments
        if word.endswith("]") and word.count("]") > word.count("["):
            word = word[:-1]
        if word and word != PLACEHOLDER:
            arguments.append(word)
    return arguments


def _run(entry: str, arguments: list[str]) -> tuple[object, str]:
    """(exit status or exception, stdout and stderr) of `python -m entry ...` (or `python entry.py`) run in this
    process, as the shell would start it; the modules it imports stay imported for the next command."""
    argv, sys.argv, environ = sys.argv, [entry, *arguments], dict(os.environ)  # run_cli sets HYDRA_FULL_ERROR
    output, status = io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before, by another
            if entry.endswith(".py"):
                runpy.run_path(str(ROOT / entry), run_name="__main__")
            else:
                runpy.run_module(entry, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        status = e.code
    except Exception as e:  # what the user would see as a traceback
        status = e
    finally:
        sys.argv = argv
        os.environ.clear()
        os.environ.update(environ)
    return status, output.getvalue()


@functools.cache
def _help(entry: str) -> tuple[bool, str]:
    """(whether the command is a Hydra app, its --help)."""
    assert entry.endswith(".py") or importlib.util.find_spec(entry), f"no module {entry}"
    status, text = _run(entry, ["--help"])
    assert status in (0, None), f"{entry} --help: {status}: {text[-500:]}"
    return "Powered by Hydra" in text or "== Config ==" in text, text


def _compose(entry: str, arguments: list[str]) -> None:
    """`--cfg job`: Hydra composes the config (recipe, groups, every key) and prints it, running nothing."""
    for argument in arguments:
        assert "=" in argument and not argument.startswith("-"), f"{argument!r} is not a Hydra override"
    status, text = _run(entry, [*arguments, "--cfg", "job"])
    if status not in (0, None) and PLACEHOLDER in str(status) + text:  # `conf=<recipe>`: any recipe
        arguments = [a for a in arguments if not (PLACEHOLDER in a and "." not in a.partition("=")[0])]
        status, text = _run(entry, [*arguments, "--cfg", "job"])
    assert status in (0, None), f"{status}\n{text[-800:]}"


def _check_files(arguments: list[str]) -> None:
    for argument in arguments:
        key, _, value = argument.partition("=")
        if key.lstrip("+~") in OUTPUT_KEYS or PLACEHOLDER in value:
            continue
        for item in value.strip("[]'\"").split(","):
            item = item.split(":", 1)[-1] if item.startswith("{") else item
            if item.startswith(PROJECT_FILES) and "*" not in item:
                assert (ROOT / item).exists(), f"{argument}: no {item} in the project"


@pytest.mark.parametrize("command", list(_all_commands()))
def test_a_documented_command_composes(command):
    words = _arguments(command)
    entry, arguments = ("train.py", words[2:]) if words[1] == "train.py" else (words[2], words[3:])
    if entry in EXTERNAL:
        for path in (w for w in arguments if w.startswith("tests/")):
            assert (ROOT / path.split("::")[0]).exists(), f"no {path}"
        return
    _check_files(arguments)
    if any(a.startswith("hydra.searchpath=") and PLACEHOLDER in a for a in arguments):
        return  # recipes in a folder of the user's (docs/new_family.md): tests/test_new_family.py runs that one
    hydra_app, help_text = _help(entry)
    if hydra_app:
        _compose(entry, arguments)
    else:  # argparse: every flag is one its --help lists
        for flag in (a.split("=")[0] for a in arguments if a.startswith("--")):
            assert re.search(rf"{re.escape(flag)}\b", help_text), f"{flag}: not a flag of {entry}: {help_text}"


def test_the_docs_show_commands():
    assert len(list(_all_commands())) > 50
