"""AdamW with linear warm-up and cosine decay: the schedule every recipe uses."""

import math
from dataclasses import dataclass

import torch

from common.config import UserError, at_least, require


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at trainer.max_steps
    warmup_steps: int = 50
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95

    def __post_init__(self):
        require(self.lr > 0, "optim.lr", self.lr, "> 0")
        require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "in [0, 1]")
        at_least(0, optim__warmup_steps=self.warmup_steps, optim__weight_decay=self.weight_decay)
        for key, beta in (("optim.beta1", self.beta1), ("optim.beta2", self.beta2)):
            require(0 <= beta < 1, key, beta, "in [0, 1)")


def check_finite(loss: torch.Tensor, step: int, run_dir) -> None:
    """Stop on a NaN/inf loss before it reaches the weights; the last checkpoint stays the last good one."""
    if not torch.isfinite(loss):
        raise UserError(f"non-finite loss ({loss.item()}) at step {step}; the last good checkpoint is in "
                        f"{run_dir}/checkpoints (resume=<run dir> after lowering optim.lr)")


def configure(params, cfg: OptimConfig, max_steps: int) -> dict:
    """The optimizer and per-step scheduler, in the form Lightning's configure_optimizers returns."""
    decay = [p for p in params if p.requires_grad and p.dim() >= 2]  # matrices, not norms/biases
    no_decay = [p for p in params if p.requires_grad and p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
    )

    def lr_factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
