"""The drafter recipe: distil a drafter from the frozen target, export it, report its acceptance."""

from dataclasses import asdict
from pathlib import Path

from inference import report
from speculators import draft_vocab, export
from speculators.config import require, to_dataclass
from speculators.families import family
from speculators.quant import QuantConfig
from speculators.target import FrozenTarget
from train.callbacks import ServeEvalCallback
from train.data import TextDataModule, load_examples
from train.hidden_cache import open_cache
from train.module import DrafterModule, plain_copy
from train.run import DrafterRecipe, fit, make_logger, make_trainer


def run_distill(recipe: DrafterRecipe, run_dir: Path) -> None:
    drafter_class = family(recipe.drafter.get("family"))
    drafter_cfg = to_dataclass(drafter_class.config_class, recipe.drafter, "drafter")
    cached = recipe.data.hidden_states == "cache"
    every = recipe.serve_eval.every_n_steps
    require(not (cached and every), "serve_eval.every_n_steps", every, "0 with data.hidden_states=cache (serving "
            "needs the whole target, which a cached run loads only for the report after training)")
    target = FrozenTarget.load(recipe.target, recipe.quant, layers=not cached)
    datamodule = TextDataModule(recipe.data, load_examples(recipe.data), target.tokenizer, recipe.seed)
    datamodule.setup("fit")
    if cached:
        datamodule.hidden = open_cache(recipe, target, datamodule)
    # The draft vocabulary is what the loss trains on: assistant/completion tokens, not prompts.
    counts = draft_vocab.count_tokens(datamodule.train_rows, datamodule.train_mask, target.vocab_size)
    drafter = drafter_class.from_target(drafter_cfg, target, counts)
    module = DrafterModule(drafter, target, recipe.optim, recipe.trainer.max_steps)

    config = asdict(recipe) | {"drafter": asdict(drafter_cfg)}
    callbacks = []
    if recipe.serve_eval.every_n_steps:
        prompts = [target.tokenizer(text)["input_ids"] for text in report.heldout_prompts(recipe.serve_eval.num_prompts)]
        callbacks.append(ServeEvalCallback(recipe.serve_eval, target, prompts, drafter.num_speculative_tokens))
    trainer = make_trainer(recipe.trainer, make_logger(recipe.logger, run_dir, config), run_dir, callbacks)
    fit(trainer, module, datamodule, recipe.resume)

    offline = trainer.validate(module, datamodule, verbose=False)[0]  # under DDP every process takes part
    drafter = plain_copy(module.drafter, lambda: drafter_class.from_target(drafter_cfg, target, counts))
    if not trainer.is_global_zero:
        return  # one process exports and reports
    export_dir = export.save(drafter, run_dir / "export", export.Verifier.of(target), overwrite=recipe.overwrite,
                             training=training_record(recipe, trainer))
    if trainer.logger:
        trainer.logger.experiment.finish()  # flush W&B before the closing lines, not after them
    if cached:
        target = FrozenTarget.load(recipe.target, recipe.quant).to(module.device)  # the whole target, to serve
    report_path = acceptance_report(drafter.eval(), target, recipe.quant, offline, run_dir / "acceptance")
    print(f"\nexport: {export_dir}\nacceptance report: {report_path}")


def training_record(recipe: DrafterRecipe, trainer) -> dict:
    """What the drafter was trained on, so comparisons can state their budgets."""
    sequences = recipe.data.batch_size * recipe.trainer.accumulate_grad_batches * trainer.world_size
    return {"family": recipe.drafter.get("family"), "steps": trainer.global_step,
            "tokens_seen": trainer.global_step * sequences * recipe.data.seq_len,
            "target": recipe.target.name_or_path, "quant": asdict(recipe.quant), "seed": recipe.seed}


def acceptance_report(drafter, target, quant: QuantConfig, offline: dict, out_dir: Path) -> Path:
    """Serve the drafter with the bundled engine on held-out prompts: the figures a serving
    engine would see. Beside them, the per-step accuracy of validation (teacher-forced).
    `quant`: how `target` was quantized at load (recorded in the report's config)."""
    steps = drafter.num_speculative_tokens
    cfg = report.InferenceConfig(drafter=str(out_dir.parent / "export"), quant=quant, num_speculative_tokens=steps)
    result = report.measure(target, drafter, report.heldout_prompts(cfg.num_prompts, cfg.prompt_lines), cfg)
    result["offline_accuracy_per_step"] = [float(offline[f"val/acc_step{j}"]) for j in range(steps)
                                           if f"val/acc_step{j}" in offline]
    return report.write(result, out_dir)
