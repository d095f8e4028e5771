"""The console commands `pip install` puts on PATH (pyproject.toml [project.scripts]). Importing this module runs
common's import-name check first, so a clash with vLLM's `speculators` ends in one line even where that
project's files have replaced our speculators/__init__.py."""

from common.config import run_cli


def train() -> None:
    """forge-train: `python train.py` of the checkout."""
    from train.__main__ import main

    run_cli(main)


def infer() -> None:
    """forge-infer: `python -m inference`."""
    from inference.__main__ import main

    run_cli(main)


def export() -> None:
    """forge-export: `python -m speculators.export`."""
    from speculators.export import main

    main()
