"""`train.run(cfg)`: turn the composed Hydra config into its typed recipe (train/recipes.py) and run it."""

from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig

from common.config import UserError, one_of, to_dataclass
from train.distill import run_distill
from train.pretrain import run_pretrain
from train.recipes import RECIPES, RESULTS


def run(cfg: DictConfig, run_dir: Path) -> None:
    one_of("recipe", cfg.get("recipe"), RECIPES)
    recipe = to_dataclass(RECIPES[cfg.recipe], cfg)
    check_result_writable(run_dir / RESULTS[cfg.recipe], recipe.overwrite)
    if recipe.trainer.num_threads:
        torch.set_num_threads(recipe.trainer.num_threads)
    L.seed_everything(recipe.seed, workers=True)
    (run_pretrain if cfg.recipe == "pretrain" else run_distill)(recipe, run_dir)


def check_result_writable(path: Path, overwrite: bool) -> None:
    """Refuse before training, not after it: a finished run's result is replaced only when asked."""
    if path.exists() and not overwrite:
        raise UserError(f"{path} already exists (resume= of a finished run?); pass overwrite=true to replace it")
