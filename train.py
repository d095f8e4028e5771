"""Train a drafter (or the default target): `python train.py conf=eagle3 [overrides]`; forge-train when installed."""

from common.config import run_cli
from train.__main__ import main

if __name__ == "__main__":
    run_cli(main)
