"""The drafter recipe: distil a drafter from the frozen target, export it, report its acceptance."""

import statistics
from dataclasses import asdict, replace
from pathlib import Path

from common.config import UserError, require, to_dataclass
from common.progress import announce
from inference import calibration, evalsets, report
from inference.drafting import DraftingConfig, lookup_drafting
from inference.planning import make_planner
from speculators import draft_vocab, export
from speculators.families import family
from speculators.target import FrozenTarget
from train.callbacks import ServeEvalCallback, wall_time
from train.chat_encoding import chat_template
from train.data import TextDataModule, check_context, heldout_conversations, load_examples
from train.hidden_cache import check_cache, open_cache
from train.module import DrafterModule, plain_copy
from train.recipes import DrafterRecipe
from train.trainer import fit, leave_process_group, make_logger, make_trainer


def run_distill(recipe: DrafterRecipe, run_dir: Path) -> None:
    drafter_class = family(recipe.drafter.get("family"))
    drafter_cfg = to_dataclass(drafter_class.config_class, recipe.drafter, "drafter")
    cached = recipe.data.hidden_states == "cache"
    every = recipe.serve_eval.every_n_steps
    require(not (cached and every), "serve_eval.every_n_steps", every, "0 with data.hidden_states=cache (serving "
            "needs the whole target, which a cached run loads only for the report after training)")
    check_context(recipe.data, recipe.target)
    examples = load_examples(recipe.data)  # before the target: a bad data file is refused in seconds, not minutes
    if cached:
        check_cache(recipe.data)
    target = FrozenTarget.load(recipe.target, recipe.quant, layers=not cached)
    drafter_cfg = fit_draft_vocab(drafter_cfg, target)
    datamodule = TextDataModule(recipe.data, examples, target.tokenizer, recipe.seed)
    datamodule.setup("fit")
    if cached:
        datamodule.hidden = open_cache(recipe, target, datamodule)
    # The draft vocabulary is what the loss trains on: assistant/completion tokens, not prompts.
    counts = draft_vocab.count_tokens(datamodule.train_rows, datamodule.train_mask, target.vocab_size)
    drafter = drafter_class.from_target(drafter_cfg, target, counts)
    if recipe.init_from:
        continue_from(drafter, recipe.init_from, target)
    module = DrafterModule(drafter, target, recipe.optim, recipe.trainer.max_steps)

    config = asdict(recipe) | {"drafter": asdict(drafter_cfg)}
    callbacks = []
    if recipe.serve_eval.every_n_steps:
        prompts = [p.ids for p in eval_prompts(recipe, target, datamodule.files["test"], turns=1)]
        callbacks.append(ServeEvalCallback(recipe.serve_eval, target, prompts[: recipe.serve_eval.num_prompts],
                                           drafter.depth))
    trainer = make_trainer(recipe.trainer, make_logger(recipe.logger, run_dir, config), run_dir, callbacks)
    fit(trainer, module, datamodule, recipe.resume)

    if trainer.is_global_zero:
        announce(f"validating on {len(datamodule.val_rows)} held-out rows (accuracy per draft step), then the "
                 f"closing report")
    offline = trainer.validate(module, datamodule, verbose=False)[0]  # under DDP every process takes part
    drafter = plain_copy(module.drafter, lambda: drafter_class.from_target(drafter_cfg, target, counts))
    leave_process_group()  # the last collective
    if not trainer.is_global_zero:
        return  # one process exports and reports
    export_dir = export.save(drafter, run_dir / "export", export.Verifier.of(target), overwrite=recipe.overwrite,
                             training=training_record(recipe, trainer, target))
    if trainer.logger:
        trainer.logger.experiment.finish()  # flush W&B before the closing lines, not after them
    if cached:  # the whole target, to serve where training ran (Lightning has moved the module back to the CPU)
        target = FrozenTarget.load(recipe.target, recipe.quant).to(trainer.strategy.root_device)
    prompts = eval_prompts(recipe, target, datamodule.files["test"])
    report_path = acceptance_report(served_export(export_dir, target), target, recipe, prompts, offline, export_dir,
                                    datamodule.files["test"])
    print(f"\nexport: {export_dir}\nacceptance report: {report_path}")


def fit_draft_vocab(drafter_cfg, target: FrozenTarget):
    """A draft vocabulary sized for large vocabularies (conf=eagle3: 32,768) is, for a target with fewer
    tokens, all of them: said in one line, since the size the export records is then the target's."""
    size = getattr(drafter_cfg, "draft_vocab_size", None)  # Medusa and EAGLE-1 draft over the whole vocabulary
    if size is None or size <= target.vocab_size:
        return drafter_cfg
    announce(f"drafter.draft_vocab_size={size} exceeds the target's vocabulary: drafting over all of its "
             f"{target.vocab_size} tokens")
    return replace(drafter_cfg, draft_vocab_size=target.vocab_size)


def continue_from(drafter, path: str, target: FrozenTarget) -> None:
    """Start from an export's weights, its draft vocabulary included (init_from=): more training on new data."""
    saved, _ = export.load(Path(path))
    steps = (export.training_record(Path(path)) or {}).get("steps")
    announce(f"starting from {path} (init_from; {steps or 'unknown'} steps of training), not from a new drafter")
    report.check_trained_for(path, saved, target)
    export.share_target_embedding(saved, target)
    if type(saved) is not type(drafter):
        raise UserError(f"init_from={path} is a {type(saved).__name__}; drafter.family builds a {type(drafter).__name__}")
    try:
        drafter.load_state_dict(saved.state_dict())
    except RuntimeError as e:
        shapes = [line.strip() for line in str(e).splitlines()[1:] if "size mismatch" in line]
        raise UserError(f"init_from={path}: its shapes differ from drafter.* ({'; '.join(shapes) or e})") from None


def training_record(recipe: DrafterRecipe, trainer, target: FrozenTarget) -> dict:
    """What the drafter was trained on, so comparisons can state their budgets; a run that continued
    another export (init_from) counts that export's steps, tokens and wall time too."""
    sequences = recipe.data.batch_size * recipe.trainer.accumulate_grad_batches * trainer.world_size
    earlier = (export.training_record(Path(recipe.init_from)) or {}) if recipe.init_from else {}
    record = {"family": recipe.drafter.get("family"), "steps": trainer.global_step + earlier.get("steps", 0),
              "tokens_seen": trainer.global_step * sequences * recipe.data.seq_len + earlier.get("tokens_seen", 0),
              "wall_time_s": round(wall_time(trainer)) + earlier.get("wall_time_s", 0),
              "target": recipe.target.name, "target_fingerprint": target.fingerprint(), "quant": asdict(recipe.quant),
              "seed": recipe.seed}
    if recipe.init_from:
        record["init_from"] = {"path": recipe.init_from, "steps": earlier.get("steps"),
                               "tokens_seen": earlier.get("tokens_seen")}
    return record


def eval_prompts(recipe: DrafterRecipe, target, test, turns: int | None = None) -> list[evalsets.Prompt]:
    """The acceptance report's prompts: the eval set the recipe names, or (eval.name=data) the run's own
    held-out split. `turns`: fewer turns than the eval set has (the serve-eval callback takes first turns)."""
    cfg = replace(recipe.eval, turns=turns or recipe.eval.turns)
    if cfg.name != "data":
        return evalsets.prompts(cfg, target, recipe.serve_eval.report_new_tokens)
    chats, chat = heldout_conversations(recipe.data, test, cfg.num_prompts, cfg.prompt_lines)
    template = chat_template(recipe.data, target.tokenizer) if chat else None  # the template training used
    return evalsets.prompts_of(evalsets.first(chats, cfg), template, target, recipe.serve_eval.report_new_tokens)


def acceptance_report(drafter, target, recipe: DrafterRecipe, prompts: list[evalsets.Prompt], offline: dict,
                      export_dir: Path, test) -> Path:
    """Serve the exported drafter with the bundled engine on held-out prompts at each K of serve_eval.ks, against
    target-only decoding in the same run: the figures a serving engine would see. The fastest K goes into
    the export (what engines serve unless told otherwise); the init_from export, served on the same prompts,
    shows what this run added. Beside them, the per-step accuracy of validation (teacher-forced)."""
    ks = [k for k in recipe.serve_eval.ks or range(1, drafter.depth + 1) if k <= drafter.depth] or [drafter.depth]
    if beyond := [k for k in recipe.serve_eval.ks or [] if k > drafter.depth]:
        announce(f"serve_eval.ks {beyond}: beyond the {drafter.depth} drafts this drafter was trained for; the closing "
                 f"report measures {ks}")
    before = served_export(recipe.init_from, target) if recipe.init_from else None
    compared_k = before.k if before and before.k in ks else max(ks)  # before and after at the same K
    arms = {k: (drafter, k) for k in sorted(ks)}
    extra = {"before": (before, compared_k)} if before else {}
    planned = plans(recipe, drafter)
    if planned:
        fitted = calibrate(recipe, target, drafter, max(ks), export_dir, test)
        extra["plan"] = (drafter, max(ks), DraftingConfig(plan=True))
    if recipe.serve_eval.lookup_tokens:
        # the plan's K and calibration when planned, else the shortest K (chains longer than one draft seldom pay)
        extra["lookup"] = (drafter, max(ks) if planned else min(ks), lookup_drafting(recipe.serve_eval.lookup_tokens,
                                                                                   planned))
    cfg = report.InferenceConfig(drafter=str(export_dir), quant=recipe.quant, eval=recipe.eval,
                                 max_new_tokens=recipe.serve_eval.report_new_tokens)
    results = report.measure_arms(target, arms | extra, prompts, cfg)
    best = max(arms, key=lambda k: results[k]["speedup"])
    export.set_best_k(export_dir, best)
    result = results[best] | {
        "plan": plan_summary(results["plan"], fitted, target, drafter, export_dir) if planned else None,
        "lookup": lookup_summary(results["lookup"]) if "lookup" in results else None,
        "k_sweep": {str(k): summary(results[k]) for k in arms},
        "init_from": {"path": recipe.init_from, **summary(results["before"]), "this_run": summary(results[compared_k]),
                      "tau_gain": paired_gain(results[compared_k], results["before"])} if before else None,
        "offline_accuracy_per_step": [float(offline[f"val/acc_step{j}"]) for j in range(drafter.depth)
                                      if f"val/acc_step{j}" in offline]}
    path = report.write(result, export_dir.parent / "acceptance")
    print(closing_lines(result, export_dir))
    return path


def plans(recipe: DrafterRecipe, drafter) -> bool:
    """Whether the closing report serves drafting.plan: serve_eval.plan, or by default where the drafter has a
    confidence head."""
    chosen = recipe.serve_eval.plan
    return chosen if chosen is not None else hasattr(drafter, "confidence_head")


def calibrate(recipe: DrafterRecipe, target, drafter, k: int, export_dir: Path, test):
    """Per-position temperatures and biases of the drafter's estimates (inference/calibration.py), fitted on
    held-out conversations of the training data (not the report's prompts), written beside the export as
    sts.json (TensorRT-LLM's layout)."""
    held_out = replace(recipe, eval=replace(recipe.eval, name="data", turns=1,
                                            num_prompts=recipe.serve_eval.calibration_prompts))
    prompts = [p.ids for p in eval_prompts(held_out, target, test)]
    announce(f"calibrating the drafter's acceptance estimates on {len(prompts)} held-out conversations")
    fitted = calibration.fit_served(target, drafter, k, prompts, recipe.serve_eval.report_new_tokens)
    if fitted:
        calibration.write_sts(fitted, export_dir / export.CALIBRATION_FILE, target)
    return fitted


def lookup_summary(figures: dict) -> dict:
    drafting = figures["config"]["drafting"]
    return summary(figures) | {key: figures[key] for key in ("num_drafts", "lookup_drafts")} | {
        "command": f"k={figures['config']['k']} drafting.prompt_lookup_max={drafting['prompt_lookup_max']} "
                   f"drafting.prompt_lookup_tokens={drafting['prompt_lookup_tokens']}"
                   + (" drafting.plan=true" if drafting["plan"] else "")}


def plan_summary(figures: dict, fitted, target, drafter, export_dir: Path) -> dict:
    """The planned arm: its figures, the estimates' reliability before and after calibration, and the step costs
    it planned with (written beside the export as sps.json, TensorRT-LLM's layout)."""
    planner = make_planner(target, drafter, figures["config"]["k"], DraftingConfig(plan=True))
    planner.costs.write_sps(export_dir / "sps.json", planner.drafter_ms())
    return summary(figures) | {"drafts_per_verify": figures["num_draft_tokens"] / max(figures["num_drafts"], 1),
                               "reliability": calibration.before_and_after(figures["estimate_pairs"], fitted),
                               "step_costs_ms": planner.costs.verify_ms}


def served_export(path, target: FrozenTarget):
    """A drafter as our engine serves it: read back from its export (its serving layers: speculators.layers'
    decoding_linears), ready for the target (export.serving: on a CPU its linear layers in int8)."""
    drafter, _ = export.load(Path(path))
    return export.serving(drafter, target)


def paired_gain(after: dict, before: dict) -> dict | None:
    """Per-prompt tau after minus before on the same prompts (the same target outputs): its mean and standard
    error; beyond the noise when the mean is more than two standard errors from zero."""
    gains = [a["acceptance_length"] - b["acceptance_length"] for a, b in zip(after["prompts"], before["prompts"])
             if a["acceptance_length"] is not None and b["acceptance_length"] is not None]
    if len(gains) < 2:
        return None
    mean, se = statistics.fmean(gains), statistics.stdev(gains) / len(gains) ** 0.5
    return {"mean": mean, "se": se, "prompts": len(gains), "beyond_noise": abs(mean) > 2 * se}


def summary(figures: dict) -> dict:
    return {"k": figures["config"]["k"]} | {key: figures[key] for key in (
        "acceptance_length", "speedup", "tokens_per_second", "baseline_tokens_per_second", "outputs_match_baseline")}


def gain_words(gain: dict | None) -> str:
    if gain is None:
        return ""
    verdict = "beyond the noise" if gain["beyond_noise"] else "within the noise"
    return f" (per prompt {gain['mean']:+.3f} +- {gain['se']:.3f} s.e. over {gain['prompts']} prompts: {verdict})"


def closing_lines(result: dict, export_dir: Path) -> str:
    """What the run made: tau and speed-up per K, the K recorded, and against what it started from."""
    sweep = "; ".join(f"K={k}: tau {s['acceptance_length']:.2f}, {s['speedup']:.2f}x" for k, s in result["k_sweep"].items())
    lines = [f"served at each K against target-only decoding, same prompts (the drafter's linear layers in "
             f"{result['drafter_linears']}): {sweep}",
             f"fastest: K={result['config']['k']} ({result['speedup']:.2f}x, outputs identical to target-only: "
             f"{result['outputs_match_baseline']}), recorded in {export_dir / 'config.json'} (speculative_tokens)"]
    if result["plan"]:
        plan, reliability = result["plan"], result["plan"]["reliability"]
        ece = f"ECE {reliability['before']['all']['ece']:.3f} -> {reliability['after']['all']['ece']:.3f}" \
            if reliability["after"]["all"].get("drafts") else "no estimates"
        lines.append(f"planned (drafting.plan, up to K={plan['k']}): tau {plan['acceptance_length']:.2f}, "
                     f"{plan['speedup']:.2f}x, {plan['drafts_per_verify']:.2f} drafts verified per step; "
                     f"estimates calibrated on held-out data ({ece}): {export_dir / 'sts.json'}, step costs: "
                     f"{export_dir / 'sps.json'}")
    if result["lookup"]:
        lookup = result["lookup"]
        lines.append(f"behind n-gram lookup (python -m inference drafter={export_dir} {lookup['command']}): tau "
                     f"{lookup['acceptance_length']:.2f}, {lookup['speedup']:.2f}x, lookup drafted "
                     f"{lookup['lookup_drafts']} of {lookup['num_drafts']} chains (outputs identical to "
                     f"target-only: {lookup['outputs_match_baseline']})")
    if result["init_from"]:
        before, after = result["init_from"], result["init_from"]["this_run"]
        lines.append(f"started from {before['path']}: tau {before['acceptance_length']:.3f} at K={before['k']} "
                     f"({before['speedup']:.2f}x); after this run: tau {after['acceptance_length']:.3f} "
                     f"({after['speedup']:.2f}x), {after['acceptance_length'] - before['acceptance_length']:+.3f}"
                     + gain_words(before["tau_gain"]))
    return "\n".join(lines)
