"""The drafter recipe: distil a drafter from the frozen target, export it, report acceptance."""

import json
from dataclasses import asdict
from pathlib import Path

import torch

from speculators import draft_vocab, export
from speculators.config import to_dataclass
from speculators.families import family
from speculators.target import FrozenTarget
from speculators.corpus import stdlib_files
from train.data import TextDataModule
from train.module import DrafterModule
from train.run import DrafterRecipe, checkpoint_to_resume, make_logger, make_trainer


def run_distill(recipe: DrafterRecipe, run_dir: Path) -> None:
    drafter_class = family(recipe.drafter.get("family"))
    drafter_cfg = to_dataclass(drafter_class.config_class, recipe.drafter, "drafter")
    target = FrozenTarget.load(recipe.target, recipe.quant)
    datamodule = TextDataModule(recipe.data, stdlib_files(recipe.data.stdlib_path, recipe.data.include_tests),
                                target.tokenizer, recipe.seed)
    datamodule.setup("fit")
    rows = datamodule.train_rows
    counts = draft_vocab.count_tokens(rows, torch.ones_like(rows), target.vocab_size)
    drafter = drafter_class.from_target(drafter_cfg, target, counts)
    module = DrafterModule(drafter, target, recipe.optim, recipe.trainer.max_steps)

    config = asdict(recipe) | {"drafter": asdict(drafter_cfg)}
    trainer = make_trainer(recipe.trainer, make_logger(recipe.logger, run_dir, config), run_dir)
    trainer.fit(module, datamodule, ckpt_path=checkpoint_to_resume(recipe.resume))

    export_dir = export.save(drafter, run_dir / "export", recipe.target.name_or_path,
                             export.verifier_architectures(target))
    report = write_offline_acceptance(trainer.validate(module, datamodule, verbose=False)[0],
                                      drafter_cfg.ttt_steps, run_dir / "acceptance.json")
    print(f"\nexport: {export_dir}\nacceptance report: {report}")


def write_offline_acceptance(val_metrics: dict, steps: int, path: Path) -> Path:
    """Per-step accuracy on held-out data: the offline acceptance curve.

    Step j's accuracy is measured with teacher-forced inputs, so it estimates the chance that
    draft token j+1 is accepted given the ones before it were; tau is estimated from their
    running products.
    """
    curve = [float(val_metrics[f"val/acc_step{j}"]) for j in range(steps)]
    tau, survive = 1.0, 1.0
    for accuracy in curve:
        survive *= accuracy
        tau += survive
    path.write_text(json.dumps({"conditional_acceptance_per_step": curve, "estimated_acceptance_length": tau,
                                "val_loss": float(val_metrics["val/loss"])}, indent=2))
    return path
