"""The Lightning Trainer every recipe runs: step-based validation and checkpoints, atomic checkpoint
files, W&B logging (offline unless configured), and a stop on SIGTERM or Ctrl-C that saves first."""

import os
import signal
import sys
import zipfile
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from common.config import UserError
from common.tracking import LoggerConfig, wandb_mode
from train.callbacks import CheckpointOnSignal, ProgressLines, TrainingRandomState, WallClock
from train.recipes import ALL_DEVICES, TrainerConfig, checkpoint_to_resume


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
    devices = torch.cuda.device_count() if cfg.devices == ALL_DEVICES else cfg.devices
    return ModelParallelStrategy(data_parallel_size=devices * cfg.num_nodes, tensor_parallel_size=1,
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
    callbacks = [*checkpoints, CheckpointOnSignal(), TrainingRandomState(), WallClock(), *extra_callbacks]
    if logger:
        callbacks.append(LearningRateMonitor("step"))
    bar = cfg.progress_bar and sys.stderr.isatty()
    precision = cfg.resolved_precision()
    if cfg.precision == "auto":
        print(f"trainer.precision=auto: {precision} ({'native' if precision != '32-true' else 'no native'} bf16 here)")
    if not bar:
        callbacks.append(ProgressLines(cfg.log_every_n_steps))
    try:
        return L.Trainer(
            max_steps=cfg.max_steps, accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes,
            strategy=lightning_strategy(cfg), precision=precision,
            accumulate_grad_batches=cfg.accumulate_grad_batches, gradient_clip_val=cfg.gradient_clip_val,
            log_every_n_steps=cfg.log_every_n_steps, val_check_interval=cfg.val_every_n_steps,
            check_val_every_n_epoch=None, logger=logger, callbacks=callbacks, default_root_dir=run_dir,
            enable_progress_bar=bar, num_sanity_val_steps=0, plugins=[AtomicCheckpointIO()],
        )
    except MisconfigurationException as e:  # e.g. trainer.accelerator=cuda on a machine without a GPU
        raise UserError(f"trainer: {str(e).strip().splitlines()[0]}") from None


UNFINISHED = "UNFINISHED"  # in the run directory: training finished, its result and closing report not yet


def fit(trainer: L.Trainer, module: L.LightningModule, datamodule, resume: str | None) -> None:
    """trainer.fit, resuming if asked. SIGTERM or a first Ctrl-C stop it at the next batch
    boundary with a checkpoint (CheckpointOnSignal) and a one-line message; a second Ctrl-C
    interrupts at once. Once it has trained, the run directory says UNFINISHED until the recipe
    (train.run) has saved its result and report."""

    def stop_at_next_step(signum, frame):
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.raise_signal(signal.SIGTERM)  # Lightning's own graceful stop

    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    if previous[signal.SIGINT] is not signal.SIG_IGN:  # nohup and background jobs ignore Ctrl-C on purpose
        signal.signal(signal.SIGINT, stop_at_next_step)
    if callable(previous[signal.SIGTERM]):  # Lightning calls a handler it finds too: its graceful stop alone
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        trainer.fit(module, datamodule, ckpt_path=checkpoint_to_resume(resume), weights_only=True)  # no pickled code
    except SIGTERMException:
        last = Path(trainer.checkpoint_callback.dirpath) / "last.ckpt"
        sys.exit(f"stopped by a signal at step {trainer.global_step}; saved {last}; continue with resume=<run dir>")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    save_final_checkpoint(trainer)
    if trainer.is_global_zero:
        (Path(trainer.default_root_dir) / UNFINISHED).write_text(
            f"training finished at step {trainer.global_step}; its result and closing report are not written yet "
            f"(resume=<this run directory> finishes them)\n")


def leave_process_group() -> None:
    """Each process leaves the process group once its last collective is done. Left to the interpreter's exit,
    Gloo's worker threads can abort a process (SIGABRT), and Lightning's launcher then kills the others, the
    one writing the export and its report among them."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def save_final_checkpoint(trainer: L.Trainer) -> None:
    """last.ckpt at the step training ended, when the checkpoint interval did not fall there: the weights the
    recipe exports, so a resume after a kill in the closing report has nothing left to train. Every process
    calls it (under fsdp saving gathers the shards)."""
    callback = trainer.checkpoint_callback
    if callback._last_global_step_saved != trainer.global_step:  # Lightning's record of its latest save
        trainer.save_checkpoint(Path(callback.dirpath) / "last.ckpt", weights_only=False)
