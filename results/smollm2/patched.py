"""Run one of the project's commands in this process, after a results script patched what it measures
(results/smollm2/depth/deep.py, results/smollm2/features/features.py): argv is the command (a script such
as train.py, or a module such as benchmarks.compare) and its overrides."""

import runpy
import sys


def run_command(argv: list[str]) -> None:
    command, sys.argv = argv[0], list(argv)
    if command.endswith(".py"):
        runpy.run_path(command, run_name="__main__")
    else:
        runpy.run_module(command, run_name="__main__", alter_sys=True)
