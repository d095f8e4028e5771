"""`train.run(cfg)`: turn the composed Hydra config into its typed recipe (train/recipes.py) and run it.

A run directory is a run's identity. A new run into one that holds a checkpoint or a result is refused
unless overwrite=true; `resume=` continues it only with the settings it trained with (those that do not
change what training computes may change, and are said); a run killed after training, before its result
and closing report were finished (UNFINISHED beside them), finishes them on `resume=`.
"""

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig

from common.config import UserError, one_of, run_dir_of, to_dataclass
from common.progress import announce, process_zero
from train.distill import run_distill
from train.pretrain import run_pretrain
from train.recipes import RECIPES, RESULTS
from train.trainer import UNFINISHED

SETTINGS = "run.json"  # the settings the run directory's checkpoints were trained with, flattened
NOT_COMPARED = {"resume", "overwrite"}
# Settings a resume may change: when and how the run logs, checks, saves and reports, where it runs, and
# how long it trains. Any other change makes a different run than the checkpoint's.
CHANGEABLE = ("trainer.max_steps", "trainer.log_every_n_steps", "trainer.val_every_n_steps",
              "trainer.checkpoint_every_n_steps", "trainer.progress_bar", "trainer.num_threads", "trainer.accelerator",
              "trainer.strategy", "logger.", "serve_eval.", "eval.", "target.device_map", "target.max_memory",
              "target.offload_folder", "quant.cpu_matmul")
# May change together, as long as their product (the sequences in one optimizer step) does not.
GLOBAL_BATCH = ("data.batch_size", "trainer.devices", "trainer.num_nodes", "trainer.accumulate_grad_batches")


def run(cfg: DictConfig, run_dir: Path) -> None:
    one_of("recipe", cfg.get("recipe"), RECIPES)
    recipe = to_dataclass(RECIPES[cfg.recipe], cfg)
    result = run_dir / RESULTS[cfg.recipe]
    recipe = check_run_dir(recipe, run_dir, result)
    if process_zero():
        save_settings(run_dir, recipe)
    if recipe.trainer.num_threads:
        torch.set_num_threads(recipe.trainer.num_threads)
    L.seed_everything(recipe.seed, workers=True)
    with one_line_on_signal(run_dir, result):
        (run_pretrain if cfg.recipe == "pretrain" else run_distill)(recipe, run_dir)
    if process_zero():
        (run_dir / UNFINISHED).unlink(missing_ok=True)  # the result and its report are whole


def check_run_dir(recipe, run_dir: Path, result: Path):
    """Refuse, before anything loads, a run that would replace another's checkpoints or result; the recipe
    to run (a resume that finishes an unfinished result replaces it)."""
    held = [p.relative_to(run_dir).as_posix() for p in [*sorted(run_dir.glob("checkpoints/*.ckpt")), result]
            if p.exists()]
    continues_here = recipe.resume is not None and Path(run_dir_of(recipe.resume, "")).resolve() == run_dir.resolve()
    if held and not continues_here and not recipe.overwrite:
        if result.exists() and not (run_dir / UNFINISHED).exists():
            raise UserError(f"{run_dir} holds a finished run ({', '.join(held)}); pass overwrite=true to start it "
                            f"over, or another hydra.run.dir")
        raise UserError(f"{run_dir} holds an unfinished run ({', '.join(held)}); continue it with resume={run_dir}, "
                        f"or pass overwrite=true to start it over")
    if recipe.resume is None and recipe.overwrite and held and process_zero():
        start_over(run_dir)
    if recipe.resume is not None:
        compare_settings(recipe)
        if result.exists() and not recipe.overwrite:
            if not (run_dir / UNFINISHED).exists():
                raise UserError(f"{result} already exists (resume= of a finished run?); pass overwrite=true to replace it")
            announce(f"{result} was saved but its run did not finish (closing report): saving it again and "
                     f"finishing the report")
            recipe = dataclasses.replace(recipe, overwrite=True)
    return recipe


def start_over(run_dir: Path) -> None:
    """overwrite=true without resume=: this run starts at step 0, so the checkpoints of the one before go (a
    kill before this run's first checkpoint would otherwise leave them to resume)."""
    for checkpoint in run_dir.glob("checkpoints/*.ckpt"):
        checkpoint.unlink()
    (run_dir / UNFINISHED).unlink(missing_ok=True)  # this run has not trained yet
    announce(f"overwrite=true: {run_dir} starts over (its checkpoints removed; its result is replaced at the end)")


# --- the settings a resume continues -------------------------------------------------------------


def flat_settings(recipe) -> dict:
    """Dotted key -> value, as JSON reads it back (tuples become lists)."""

    def flatten(tree: dict, prefix: str = ""):
        for key, value in tree.items():
            if isinstance(value, dict) and value:
                yield from flatten(value, f"{prefix}{key}.")
            elif prefix + key not in NOT_COMPARED:
                yield prefix + key, value

    return json.loads(json.dumps(dict(flatten(dataclasses.asdict(recipe))), default=str))


def save_settings(run_dir: Path, recipe) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)  # Hydra makes it; train.run.run called directly may not have
    partial = run_dir / f"{SETTINGS}.partial"
    partial.write_text(json.dumps(flat_settings(recipe), indent=1) + "\n")
    os.replace(partial, run_dir / SETTINGS)


def compare_settings(recipe) -> None:
    """A changed setting that changes what training computes is refused, naming it; the others are applied, said."""
    saved_path = Path(run_dir_of(recipe.resume, "")) / SETTINGS
    if not saved_path.is_file():
        announce(f"resume={recipe.resume}: no {SETTINGS} beside its checkpoints (a run of an earlier version?); "
                 f"its settings are not compared with these")
        return
    saved, now = json.loads(saved_path.read_text()), flat_settings(recipe)
    changed = {key: (saved.get(key), now.get(key)) for key in sorted(saved.keys() | now.keys())
               if saved.get(key) != now.get(key)}
    batch_changed = global_batch(saved) != global_batch(now)
    refused = [key for key in changed if not key.startswith(CHANGEABLE) and (key not in GLOBAL_BATCH or batch_changed)]
    if refused:
        raise UserError(f"resume={recipe.resume} changes what training computes: {changes(changed, refused)}; pass "
                        f"them as the run had them, or start a new run (init_from=<its export> continues its weights)")
    if changed:
        notes = [f"the same {global_batch(now)} sequences per step"] if any(k in GLOBAL_BATCH for k in changed) else []
        if any(k in ("trainer.devices", "trainer.num_nodes") for k in changed):
            notes.append("the same rows in each step, split among the processes; its loss the mean of theirs, equal "
                         "to one process's where each holds as many loss tokens")
        if "trainer.max_steps" in changed:
            notes.append(f"the learning rate's cosine now ends at step {now['trainer.max_steps']}")
        announce(f"resume={recipe.resume}: applied {changes(changed, list(changed))}"
                 + (f" ({'; '.join(notes)})" if notes else ""))


def global_batch(settings: dict) -> int:
    devices = settings.get("trainer.devices", 1)
    if devices == -1:  # every visible GPU
        devices = torch.cuda.device_count()
    return (settings.get("data.batch_size", 1) * devices * settings.get("trainer.num_nodes", 1)
            * settings.get("trainer.accumulate_grad_batches", 1))


def changes(changed: dict, keys: list[str]) -> str:
    return ", ".join(f"{key} {changed[key][0]!r} -> {changed[key][1]!r}" for key in keys)


# --- signals outside training --------------------------------------------------------------------


@contextlib.contextmanager
def one_line_on_signal(run_dir: Path, result: Path):
    """SIGTERM or Ctrl-C outside training (loading, exporting, the closing report) end the run with one
    line saying what is kept; during training Lightning stops at the next step with a checkpoint
    (train.trainer.fit holds these handlers off meanwhile)."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers are the main thread's
        yield
        return

    def stop(signum, frame):
        sys.exit(stopped_line(signal.Signals(signum).name, run_dir, result))

    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    for signum, handler in previous.items():
        if handler is not signal.SIG_IGN:  # nohup and background jobs ignore Ctrl-C on purpose
            signal.signal(signum, stop)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def stopped_line(name: str, run_dir: Path, result: Path) -> str:
    if (run_dir / UNFINISHED).exists():
        return (f"stopped by {name} after training, before {result.name}/ and its closing report were finished; "
                f"finish them with resume={run_dir}")
    if (run_dir / "checkpoints" / "last.ckpt").exists():
        return f"stopped by {name} before training went on; continue with resume={run_dir}"
    return f"stopped by {name} before training started; nothing was saved"
