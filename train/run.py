"""`train.run(cfg)`: turn the composed Hydra config into typed recipes and run one.

Two recipes share the Trainer, logger and checkpoint set-up below:
- drafter (conf=eagle3, ...): distil a drafter from a frozen target, then export it;
- pretrain (conf=target_pretrain): pretrain the shipped default target.
"""

import os
import signal
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException
from omegaconf import DictConfig

from speculators.config import UserError, at_least, one_of, require, to_dataclass
from speculators.quant import QuantConfig
from speculators.target import TargetConfig
from train.callbacks import CheckpointOnSignal, ProgressLines, ServeEvalConfig, TrainingRandomState
from train.data import DataConfig
from train.optim import OptimConfig
from train.pretrain import ModelConfig, UnlikelihoodConfig

ACCELERATORS = ("auto", "cpu", "cuda", "gpu", "mps", "tpu")
PRECISIONS = ("32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
# ddp: one process per device, gradients all-reduced (gloo on CPU, nccl on GPU); fsdp: the same
# processes, each holding a shard of the drafter's weights, gradients and optimizer state (FSDP2)
STRATEGIES = ("auto", "ddp", "fsdp")


@dataclass
class TrainerConfig:
    """Lightning Trainer settings (the `trainer` config group)."""

    max_steps: int = 500
    accelerator: str = "cpu"
    devices: int = 1  # per node
    num_nodes: int = 1
    strategy: str = "auto"
    precision: str = "32-true"
    num_threads: int | None = None  # torch intra-op threads on CPU; None: torch's default
    accumulate_grad_batches: int = 1
    gradient_clip_val: float = 1.0
    log_every_n_steps: int = 10
    val_every_n_steps: int = 100
    checkpoint_every_n_steps: int = 100
    progress_bar: bool = True  # a bar on a terminal; false, or output to a file: a line every log_every_n_steps
    # (step, loss, s/step, time left) instead, since a redirected bar shows nothing until it ends

    def __post_init__(self):
        one_of("trainer.accelerator", self.accelerator, ACCELERATORS)
        one_of("trainer.precision", self.precision, PRECISIONS)
        one_of("trainer.strategy", self.strategy, STRATEGIES)
        at_least(1, trainer__max_steps=self.max_steps, trainer__devices=self.devices, trainer__num_nodes=self.num_nodes,
                 trainer__accumulate_grad_batches=self.accumulate_grad_batches,
                 trainer__log_every_n_steps=self.log_every_n_steps, trainer__val_every_n_steps=self.val_every_n_steps,
                 trainer__checkpoint_every_n_steps=self.checkpoint_every_n_steps)
        at_least(0, trainer__gradient_clip_val=self.gradient_clip_val)
        if self.num_threads is not None:
            at_least(1, trainer__num_threads=self.num_threads)


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


@dataclass
class RunKeys:
    """The top-level keys of conf/config.yaml, shared by every recipe."""

    recipe: str
    seed: int
    resume: str | None
    overwrite: bool  # replace the run's result (export/, model/) if the run directory already has one

    def __post_init__(self):
        require(0 <= self.seed < 2**32, "seed", self.seed, "in [0, 2**32 - 1] (NumPy's seed range)")
        checkpoint_to_resume(self.resume)  # a mistyped path fails now, not after the target has loaded


@dataclass
class PretrainRecipe(RunKeys):
    init_from: str | None  # a saved target (its folder) whose weights and tokenizer this run continues training
    data: DataConfig
    trainer: TrainerConfig
    logger: LoggerConfig
    optim: OptimConfig
    model: ModelConfig
    unlikelihood: UnlikelihoodConfig


@dataclass
class DrafterRecipe(RunKeys):
    target: TargetConfig
    data: DataConfig
    quant: QuantConfig
    trainer: TrainerConfig
    logger: LoggerConfig
    optim: OptimConfig
    serve_eval: ServeEvalConfig
    drafter: Any  # the family's own config dataclass, chosen by drafter.family


RECIPES: dict[str, Any] = {"drafter": DrafterRecipe, "pretrain": PretrainRecipe}
RESULTS = {"drafter": "export", "pretrain": "model"}  # the folder each recipe writes into its run directory last


def run(cfg: DictConfig, run_dir: Path) -> None:
    one_of("recipe", cfg.get("recipe"), RECIPES)
    recipe = to_dataclass(RECIPES[cfg.recipe], cfg)
    check_result_writable(run_dir / RESULTS[cfg.recipe], recipe.overwrite)
    if recipe.trainer.num_threads:
        torch.set_num_threads(recipe.trainer.num_threads)
    L.seed_everything(recipe.seed, workers=True)
    if cfg.recipe == "pretrain":
        from train.pretrain import run_pretrain
        run_pretrain(recipe, run_dir)
    else:
        from train.distill import run_distill
        run_distill(recipe, run_dir)


def check_result_writable(path: Path, overwrite: bool) -> None:
    """Refuse before training, not after it: a finished run's result is replaced only when asked."""
    if path.exists() and not overwrite:
        raise UserError(f"{path} already exists (resume= of a finished run?); pass overwrite=true to replace it")


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


def make_logger(cfg: LoggerConfig, run_dir: Path, config: dict):
    if cfg.kind == "none":
        return False
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    mode = wandb_mode(cfg)
    if mode != "online":  # process-wide too: W&B's own analytics go online unless its global settings say offline
        wandb.setup(wandb.Settings(mode=mode))
    return WandbLogger(project=cfg.project, name=cfg.name or run_dir.name, save_dir=str(run_dir), mode=mode,
                       config=config)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write each checkpoint to a temporary file and rename it into place: a run killed while
    saving keeps its previous checkpoint whole. Refuse a corrupt or truncated one on loading."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        partial = Path(f"{path}.partial")
        super().save_checkpoint(checkpoint, partial, storage_options)
        os.replace(partial, path)

    def load_checkpoint(self, path, *args, **kwargs) -> dict:
        # torch.load reads a checkpoint (a zip archive) without checking the CRC32 of each
        # member, so flipped bytes would load as silently wrong weights; zipfile checks them.
        try:
            with zipfile.ZipFile(path) as archive:
                damaged = archive.testzip()
            checkpoint = None if damaged else super().load_checkpoint(path, *args, **kwargs)
        except Exception as e:  # truncated, not a zip, or pickled objects beyond weights
            raise UserError(f"resume: cannot read checkpoint {path} ({type(e).__name__}); it is truncated, corrupt "
                            "or not a checkpoint of this project") from None
        if damaged:
            raise UserError(f"resume: checkpoint {path} is corrupt ({damaged} fails its checksum)")
        if not isinstance(checkpoint, dict) or not {"state_dict", "optimizer_states", "global_step"} <= checkpoint.keys():
            raise UserError(f"resume: {path} is not a training checkpoint of this project")
        return checkpoint


def lightning_strategy(cfg: TrainerConfig):
    if cfg.strategy != "fsdp":
        return cfg.strategy
    from lightning.pytorch.strategies import ModelParallelStrategy

    # Every process one data-parallel shard, no tensor parallelism; checkpoints hold the whole
    # state (one file, as under ddp), so a run resumes under any strategy and process count.
    return ModelParallelStrategy(data_parallel_size=cfg.devices * cfg.num_nodes, tensor_parallel_size=1,
                                 save_distributed_checkpoint=False)


def make_trainer(cfg: TrainerConfig, logger, run_dir: Path, extra_callbacks=(), monitor: str | None = None) -> L.Trainer:
    """A step-based Trainer: validation and checkpoints every N optimizer steps, last.ckpt kept,
    and a checkpoint written when a signal stops the run."""
    checkpoints = [ModelCheckpoint(dirpath=run_dir / "checkpoints", every_n_train_steps=cfg.checkpoint_every_n_steps,
                                   save_last=True, save_top_k=0,
                                   enable_version_counter=False)]  # resumed into its own run dir: last.ckpt stays the newest
    if monitor:  # saved when validation ends, so best.ckpt is scored by its own step's validation, not the one before
        checkpoints.append(ModelCheckpoint(dirpath=run_dir / "checkpoints", monitor=monitor, save_top_k=1, filename="best",
                                           save_on_train_epoch_end=False, enable_version_counter=False))
    callbacks = [*checkpoints, CheckpointOnSignal(), TrainingRandomState(), *extra_callbacks]
    if logger:
        callbacks.append(LearningRateMonitor("step"))
    bar = cfg.progress_bar and sys.stderr.isatty()
    if not bar:
        callbacks.append(ProgressLines(cfg.log_every_n_steps))
    try:
        return L.Trainer(
            max_steps=cfg.max_steps, accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes,
            strategy=lightning_strategy(cfg), precision=cfg.precision,
            accumulate_grad_batches=cfg.accumulate_grad_batches, gradient_clip_val=cfg.gradient_clip_val,
            log_every_n_steps=cfg.log_every_n_steps, val_check_interval=cfg.val_every_n_steps,
            check_val_every_n_epoch=None, logger=logger, callbacks=callbacks, default_root_dir=run_dir,
            enable_progress_bar=bar, num_sanity_val_steps=0, plugins=[AtomicCheckpointIO()],
        )
    except MisconfigurationException as e:  # e.g. trainer.accelerator=cuda on a machine without a GPU
        raise UserError(f"trainer: {str(e).strip().splitlines()[0]}") from None


def fit(trainer: L.Trainer, module: L.LightningModule, datamodule, resume: str | None) -> None:
    """trainer.fit, resuming if asked. SIGTERM or a first Ctrl-C stop it at the next batch
    boundary with a checkpoint (CheckpointOnSignal) and a one-line message; a second Ctrl-C
    interrupts at once."""

    def stop_at_next_step(signum, frame):
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.raise_signal(signal.SIGTERM)  # Lightning's own graceful stop

    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.SIG_IGN:  # nohup and background jobs ignore Ctrl-C on purpose
        signal.signal(signal.SIGINT, stop_at_next_step)
    try:
        trainer.fit(module, datamodule, ckpt_path=checkpoint_to_resume(resume), weights_only=True)  # no pickled code
    except SIGTERMException:
        last = Path(trainer.checkpoint_callback.dirpath) / "last.ckpt"
        sys.exit(f"stopped by a signal at step {trainer.global_step}; saved {last}; continue with resume=<run dir>")
    finally:
        signal.signal(signal.SIGINT, previous)


def checkpoint_to_resume(resume: str | None) -> str | None:
    """`resume` is a checkpoint file or a run directory (its checkpoints/last.ckpt)."""
    if resume is None:
        return None
    path = Path(resume)
    if path.is_dir():
        path = path / "checkpoints" / "last.ckpt"
    if not path.is_file():
        raise UserError(f"resume={resume}: no checkpoint at {path}")
    return str(path)
