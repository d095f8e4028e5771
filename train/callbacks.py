"""Training callbacks: acceptance measured as serving measures it, and stopping on a signal.

ServeEvalCallback: every N optimizer steps the drafter is served by the bundled engine
(inference.engine) on a few held-out prompts; tau and the per-position acceptance curve are
logged under serve/. Teacher-forced accuracy (val/acc_step*) tends to flatter a drafter.

CheckpointOnSignal: SIGTERM (pre-emption) or a first Ctrl-C ends training at the next batch
boundary and writes checkpoints/last.ckpt, so `resume=<run dir>` loses nothing.

ProgressLines: with trainer.progress_bar=false (logs of batch jobs, where a bar's carriage
returns pile up), one line every log_every_n_steps: step, the metrics a bar would show, seconds
per step, time left; and one line of validation metrics after each validation.

TrainingRandomState: the random streams training steps draw from travel in the checkpoint, so
a resumed run draws the same noise and dropout masks as an uninterrupted one.
"""

import random
import time
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from common.config import at_least, require
from inference.engine import Stats, generate
from train.module import unsharded


@dataclass
class ServeEvalConfig:
    """Serving the drafter with the bundled engine: every_n_steps during training (num_prompts, max_new_tokens),
    and at the end the closing report (report_new_tokens), which measures each K of `ks` and records the fastest in
    the export."""

    every_n_steps: int = 100  # 0 disables it
    num_prompts: int = 2
    max_new_tokens: int = 32
    report_new_tokens: int = 64  # per prompt in the closing report: as long as the target's answers run, since
    # drafts of an answer's later tokens are accepted more often than of its first (and prefill weighs less)
    ks: list[int] | None = None  # K the closing report measures (those up to the drafter's depth); None: 1 to it
    plan: bool | None = None  # the closing report also serves drafting.plan, calibrated on the data's held-out
    # conversations (sts.json and sps.json beside the export); None: for drafters with a confidence head (DSpark)
    calibration_prompts: int = 4  # held-out conversations of the training data that fit the calibration
    lookup_tokens: int = 5  # the closing report also serves the drafter behind n-gram lookup chains of up to this
    # many tokens (drafting.prompt_lookup_max=3, prompt_lookup_tokens): at the shortest K, or planned; 0: not

    def __post_init__(self):
        at_least(0, serve_eval__every_n_steps=self.every_n_steps, serve_eval__lookup_tokens=self.lookup_tokens)
        at_least(1, serve_eval__num_prompts=self.num_prompts, serve_eval__max_new_tokens=self.max_new_tokens,
                 serve_eval__report_new_tokens=self.report_new_tokens,
                 serve_eval__calibration_prompts=self.calibration_prompts)
        require(self.ks is None or (self.ks and min(self.ks) >= 1), "serve_eval.ks", self.ks,
                "a list of K >= 1, or null for 1 to the drafter's depth")


class ServeEvalCallback(L.Callback):
    def __init__(self, cfg: ServeEvalConfig, target, prompts: list[list[int]], k: int):
        self.cfg, self.target, self.prompts, self.k = cfg, target, prompts, k

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *_) -> None:
        if trainer.global_step % self.cfg.every_n_steps:
            return
        stats = Stats(self.k)
        with unsharded(module.drafter.eval()) as drafter:
            for ids in self.prompts:
                stats.add(generate(self.target, drafter, ids, self.cfg.max_new_tokens, self.k).stats)
        drafter.train()
        module.log("serve/acceptance_length", stats.acceptance_length, prog_bar=True)
        for i, rate in enumerate(stats.acceptance_rates, 1):
            module.log(f"serve/acceptance_pos{i}", rate)


class CheckpointOnSignal(L.Callback):
    """Lightning stops at the next batch boundary after SIGTERM (train.trainer.fit turns a first
    Ctrl-C into one); write last.ckpt before the run ends."""

    def on_exception(self, trainer: L.Trainer, module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            trainer.save_checkpoint(Path(trainer.checkpoint_callback.dirpath) / "last.ckpt", weights_only=False)


class TrainingRandomState(L.Callback):
    """Checkpoints carry the torch (CPU and CUDA), Python and NumPy random states; Lightning
    restores none of them.

    Training steps continue their own streams: whatever draws between two steps (validation, a
    data loader starting, serve evaluation) is undone when the next step starts. So the state
    saved at a step boundary is the one the next step starts from, in the run that goes on and
    in the run that resumes (which skips those draws or makes others).
    """

    def __init__(self):
        self.state = None  # after the last training step; None until a fresh run's first step ends

    def on_train_batch_start(self, *_) -> None:
        if self.state is not None:
            set_random_state(self.state)

    def on_train_batch_end(self, *_) -> None:
        self.state = random_state()

    def state_dict(self) -> dict:
        return {"random_state": self.state}

    def load_state_dict(self, state: dict) -> None:
        self.state = state["random_state"]


def random_state() -> dict:
    """Tensors, tuples and numbers only: checkpoints load with torch.load(weights_only=True)."""
    algorithm, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (algorithm, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_random_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    algorithm, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((algorithm, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class WallClock(L.Callback):
    """Training wall time across resumes: saved in each checkpoint (as "wall_time", seconds), added
    back when a run resumes from it, so training.json states the whole run's time."""

    def __init__(self):
        self.before, self.started = 0.0, time.time()

    @property
    def seconds(self) -> float:
        return self.before + time.time() - self.started

    def on_save_checkpoint(self, trainer, module, checkpoint: dict) -> None:
        checkpoint["wall_time"] = self.seconds

    def on_load_checkpoint(self, trainer, module, checkpoint: dict) -> None:
        self.before, self.started = checkpoint.get("wall_time", 0.0), time.time()


def wall_time(trainer: L.Trainer) -> float:
    """Seconds this run (with the runs it resumed) has trained: make_trainer gives every trainer a WallClock."""
    return next(c for c in trainer.callbacks if isinstance(c, WallClock)).seconds


class ProgressLines(L.Callback):
    def __init__(self, every_n_steps: int):
        self.every_n_steps, self.since = every_n_steps, None

    def on_train_start(self, trainer, module) -> None:
        self.since = (time.perf_counter(), trainer.global_step)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every_n_steps or not trainer.is_global_zero or step == self.since[1]:
            return
        per_step = (time.perf_counter() - self.since[0]) / (step - self.since[1])
        left = per_step * (trainer.max_steps - step)
        logged = metrics_line(trainer, "train/")  # the latest of each: train/loss, train/unlikelihood, ...
        print(f"step {step}/{trainer.max_steps}  {logged}  {per_step:.2f} s/step  {left / 60:.0f} min left", flush=True)

    def on_validation_end(self, trainer, module) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking and trainer.state.fn == "fit":  # not trainer.validate()
            print(f"validation at step {trainer.global_step}: {metrics_line(trainer, 'val/')}", flush=True)


def metrics_line(trainer, prefix: str) -> str:
    metrics = sorted((k, v) for k, v in trainer.progress_bar_metrics.items() if k.startswith(prefix))
    return "  ".join(f"{name} {float(value):.4f}" for name, value in metrics)
