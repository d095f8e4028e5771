"""Resuming from a checkpoint continues exactly: same batches, same random draws, same losses, bit
for bit on the CPU, also after SIGTERM or Ctrl-C stopped the run (it saves a checkpoint on the way
out). A non-finite loss stops the run with one line and leaves the last good checkpoint."""

import dataclasses
import json
import os
import random
import signal
import string
import textwrap
from pathlib import Path

import datasets
import lightning as L
import numpy as np
import pytest
import torch

from common.config import UserError
from common.tracking import LoggerConfig
from speculators import draft_vocab
from speculators.eagle3 import Eagle3Config, Eagle3Drafter
from train.callbacks import TrainingRandomState, wall_time
from train.data import DataConfig, TextDataModule
from train.module import DrafterModule
from train.optim import OptimConfig
from train.recipes import TrainerConfig
from train.trainer import fit, make_logger, make_trainer


class RecordLosses(L.Callback):
    def __init__(self):
        self.losses = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = float(outputs["loss"])


def small_corpus() -> datasets.DatasetDict:
    texts = [Path(m.__file__).read_text() for m in (json.decoder, json.encoder, textwrap, string)]
    split = {"path": [f"f{i}.py" for i in range(len(texts))], "text": texts}
    return datasets.DatasetDict({s: datasets.Dataset.from_dict(split) for s in ("train", "validation", "test")})


class SendSignal(L.Callback):
    """Signal our own process after optimizer step `at_step`, as a scheduler or a user would."""

    def __init__(self, at_step: int, signum: int):
        self.at_step, self.signum = at_step, signum

    def on_train_batch_end(self, trainer, *_):
        if trainer.global_step == self.at_step:
            os.kill(os.getpid(), self.signum)


def train(target, run_dir: Path, max_steps: int, resume: str | None = None, callbacks=()) -> dict:
    """A drafter run as the recipe builds it (Trainer, checkpoints, DataModule state), no logger."""
    L.seed_everything(0)
    data = TextDataModule(DataConfig(seq_len=32, batch_size=2, max_val_sequences=2), small_corpus(), target.tokenizer, 0)
    data.setup("fit")
    counts = draft_vocab.count_tokens(data.train_rows, torch.ones_like(data.train_rows), target.vocab_size)
    drafter = Eagle3Drafter.from_target(Eagle3Config(depth=2, draft_vocab_size=64), target, counts)
    module = DrafterModule(drafter, target, OptimConfig(lr=1e-2, warmup_steps=2), max_steps=6)
    recorder = RecordLosses()
    trainer = make_trainer(TrainerConfig(max_steps=max_steps, val_every_n_steps=3, checkpoint_every_n_steps=3,
                                         progress_bar=False), make_logger(LoggerConfig(kind="none"), run_dir, {}),
                           run_dir, [recorder, *callbacks])
    fit(trainer, module, data, resume)
    return recorder.losses


class RecordWallTime(L.Callback):
    def on_train_end(self, trainer, module):
        self.seconds = wall_time(trainer)


def test_resumed_run_counts_the_wall_time_of_the_run_it_resumed(llama_target, tmp_path):
    train(llama_target, tmp_path / "first", max_steps=3)
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, map_location="cpu", weights_only=False)
    assert 0 < checkpoint["wall_time"] < 600
    checkpoint["wall_time"] = 10_000.0  # as if the first run had trained for hours
    torch.save(checkpoint, last)
    clock = RecordWallTime()
    train(llama_target, tmp_path / "resumed", max_steps=6, resume=str(tmp_path / "first"), callbacks=[clock])
    assert 10_000 < clock.seconds < 10_600


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(llama_target, tmp_path):
    straight = train(llama_target, tmp_path / "straight", max_steps=6)
    train(llama_target, tmp_path / "interrupted", max_steps=3)
    resumed = train(llama_target, tmp_path / "resumed", max_steps=6, resume=str(tmp_path / "interrupted"))
    assert sorted(resumed) == [4, 5, 6]
    assert [resumed[s] for s in (4, 5, 6)] == [straight[s] for s in (4, 5, 6)]


def test_the_last_step_is_checkpointed_off_the_interval_and_resumes_exactly(llama_target, tmp_path):
    """4 steps, checkpoints every 3: last.ckpt still holds step 4 (what the recipe exports), and goes on from there."""
    straight = train(llama_target, tmp_path / "straight", max_steps=6)
    train(llama_target, tmp_path / "first", max_steps=4)
    assert torch.load(tmp_path / "first" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4
    resumed = train(llama_target, tmp_path / "resumed", max_steps=6, resume=str(tmp_path / "first"))
    assert sorted(resumed) == [5, 6] and [resumed[s] for s in (5, 6)] == [straight[s] for s in (5, 6)]


@pytest.fixture
def interactive_sigint():
    """Ctrl-C as in a terminal (CI runs us in the background, where SIGINT is ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_a_checkpoint_and_resume_continues_exactly(llama_target, tmp_path, signum, interactive_sigint):
    straight = train(llama_target, tmp_path / "straight", max_steps=6)
    with pytest.raises(SystemExit, match="stopped by a signal at step 2"):
        train(llama_target, tmp_path / "stopped", max_steps=6, callbacks=[SendSignal(2, signum)])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C behaves as usual again
    resumed = train(llama_target, tmp_path / "resumed", max_steps=6, resume=str(tmp_path / "stopped"))
    assert sorted(resumed) == [3, 4, 5, 6]
    assert [resumed[s] for s in (3, 4, 5, 6)] == [straight[s] for s in (3, 4, 5, 6)]


@pytest.fixture
def noisy_training(monkeypatch):
    """Training steps that draw from every global random stream: torch (as EAGLE-1's feature noise,
    dropout and drop-token sampling do), Python's random and NumPy (as a user's own family might)."""
    real_loss = Eagle3Drafter.training_loss

    def noisy_loss(self, target_out, input_ids, loss_mask):
        if self.training:
            width = 0.5 + random.random() + float(np.random.rand())
            aux = [h + (torch.rand_like(h) - 0.5) * width for h in target_out.aux_hidden]
            target_out = dataclasses.replace(target_out, aux_hidden=aux)
        return real_loss(self, target_out, input_ids, loss_mask)

    monkeypatch.setattr(Eagle3Drafter, "training_loss", noisy_loss)


def stop_and_resume(target, tmp_path, how: str) -> tuple[dict, int]:
    """Stop a run (SIGTERM after step 2, or the end of a 3-step run, whose checkpoint validation
    follows), resume it to step 6; return the resumed losses and the first resumed step."""
    if how == "sigterm":
        with pytest.raises(SystemExit, match="stopped by a signal at step 2"):
            train(target, tmp_path / "stopped", max_steps=6, callbacks=[SendSignal(2, signal.SIGTERM)])
    else:
        train(target, tmp_path / "stopped", max_steps=3)
    resumed = train(target, tmp_path / "resumed", max_steps=6, resume=str(tmp_path / "stopped"))
    return resumed, min(resumed)


@pytest.mark.parametrize("how", ["sigterm", "checkpoint"])
def test_resume_continues_the_random_streams_exactly(llama_target, tmp_path, noisy_training, how):
    straight = train(llama_target, tmp_path / "straight", max_steps=6)
    resumed, first = stop_and_resume(llama_target, tmp_path, how)
    assert sorted(resumed) == list(range(first, 7)) and first == (3 if how == "sigterm" else 4)
    assert [resumed[s] for s in range(first, 7)] == [straight[s] for s in range(first, 7)]


def test_without_the_random_state_a_noisy_resume_diverges(llama_target, tmp_path, noisy_training, monkeypatch):
    """The control: the noise reaches the losses, and restoring the random state is what keeps them equal."""
    straight = train(llama_target, tmp_path / "straight", max_steps=6)
    monkeypatch.setattr(TrainingRandomState, "load_state_dict", lambda self, state: None)
    resumed, first = stop_and_resume(llama_target, tmp_path, "sigterm")
    assert resumed[first] != straight[first]


def test_a_non_finite_loss_stops_training_and_keeps_the_last_good_checkpoint(llama_target, tmp_path, monkeypatch):
    real_loss = Eagle3Drafter.training_loss

    def diverging_after_step_3(self, *args):
        loss, metrics = real_loss(self, *args)
        return (loss * float("nan") if self.training and poisoned["on"] else loss), metrics

    poisoned = {"on": False}
    monkeypatch.setattr(Eagle3Drafter, "training_loss", diverging_after_step_3)

    class PoisonAfter(L.Callback):
        def on_train_batch_end(self, trainer, *_):
            poisoned["on"] = trainer.global_step >= 3

    with pytest.raises(UserError, match="non-finite loss .* at step 4"):
        train(llama_target, tmp_path / "run", max_steps=6, callbacks=[PoisonAfter()])
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 3
    assert all(torch.isfinite(t).all() for t in checkpoint["state_dict"].values() if t.is_floating_point())


def test_a_checkpoint_leaves_out_the_frozen_weights_and_refuses_another_drafters():
    """The target's weights a drafter holds frozen (its embedding) are rebuilt, not saved: a checkpoint without
    them loads; one missing a trained weight, or holding a weight this drafter lacks, is refused in one line."""
    drafter = torch.nn.Module()
    drafter.embed = torch.nn.Embedding(4, 2).requires_grad_(False)
    drafter.fc = torch.nn.Linear(2, 2)
    module = DrafterModule(drafter, None, OptimConfig(), max_steps=1)
    saved = {name: t for name, t in module.state_dict().items() if name != "drafter.embed.weight"}
    module.on_load_checkpoint({"state_dict": saved})
    with pytest.raises(UserError, match=r"missing \['drafter.fc.bias'\]"):
        module.on_load_checkpoint({"state_dict": {n: t for n, t in saved.items() if n != "drafter.fc.bias"}})
    with pytest.raises(UserError, match=r"unexpected \['drafter.head.weight'\]"):
        module.on_load_checkpoint({"state_dict": saved | {"drafter.head.weight": torch.zeros(1)}})
