"""Experiment tracking both training and the inference reports use: W&B, offline unless configured."""

import os
from dataclasses import dataclass
from pathlib import Path

from common.config import one_of


@dataclass
class LoggerConfig:
    """Experiment tracking (the `logger` group): W&B, offline unless configured, or none."""

    kind: str = "wandb"
    project: str = "speculators"
    mode: str | None = None  # online/offline; None: WANDB_MODE, else online if logged in, else offline
    name: str | None = None

    def __post_init__(self):
        one_of("logger.kind", self.kind, ("wandb", "none"))
        one_of("logger.mode", self.mode, (None, "online", "offline", "disabled"))


def wandb_mode(cfg: LoggerConfig) -> str:
    if cfg.mode:
        return cfg.mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    logged_in = os.environ.get("WANDB_API_KEY") or "api.wandb.ai" in _netrc()
    return "online" if logged_in else "offline"


def _netrc() -> str:
    path = Path.home() / ".netrc"
    return path.read_text() if path.is_file() else ""
