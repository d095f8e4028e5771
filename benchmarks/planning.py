"""Cost-aware verification against fixed K: every drafter at each fixed K and with drafting.plan, one target, the
same prompts, interleaved with target-only decoding (benchmarks.compare's rows and loop).

    python -m benchmarks.planning drafters=[runs/a/export,...] [quant=gguf] [eval=mtbench] [ks=[1,2,4]]
        [lookup_tokens=5] [out=DIR]

First a calibration pass per drafter on the first `calibration_prompts` prompts (left out of the timing): every
draft up to K verified and its acceptance estimate recorded, from which a temperature and a bias per position are
fitted (inference/calibration.py). The plan rows then serve with them and the step costs measured on this
machine (inference/planning.py). Reported per drafter: the estimates' reliability (ECE, AUROC, Brier) on the timed
prompts before and after the scaling, and the cost table; sts.json and sps.json (TensorRT-LLM's layouts) are
written per drafter under <out>/<drafter>/ and, with beside_export=true, into the export folder itself.
"""

from dataclasses import asdict, dataclass, field
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from benchmarks import compare
from benchmarks.tables import write_result
from common.config import PROJECT_ROOT, UserError, at_least, exit_on_user_error, run_cli, to_dataclass
from inference import calibration, evalsets
from inference.drafting import DraftingConfig, lookup_drafting, serving_k
from inference.evalsets import EvalConfig
from speculators.quant import QuantConfig


@dataclass
class PlanningConfig:
    drafters: list[str] = field(default_factory=list)  # export folders, all for the same target
    target: str | None = None  # None: the verifier the first drafter's config names
    quant: QuantConfig = field(default_factory=QuantConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ks: list[int] | None = None  # fixed K rows per drafter (those up to its depth); None: 1 to its own K
    calibration_prompts: int = 4  # the first N prompts fit the temperatures and are not timed; 0: no scaling
    max_new_tokens: int = 64
    repeats: int = 3
    beside_export: bool = False  # also write sts.json and sps.json into each export folder
    lookup_tokens: int = 0  # > 0: per drafter also its shortest K and its plan behind n-gram lookup chains of up
    # to this many tokens (the plan reads lookup's own counts)
    out: str | None = None

    def __post_init__(self):
        if not self.drafters:
            raise UserError("drafters=[...]: give at least one export folder")
        at_least(0, calibration_prompts=self.calibration_prompts, lookup_tokens=self.lookup_tokens)
        at_least(1, max_new_tokens=self.max_new_tokens, repeats=self.repeats)
        for k in self.ks or []:
            at_least(1, ks=k)


def rows_of(drafters, cfg: PlanningConfig) -> list[compare.Method]:
    """Target-only, then per drafter its fixed-K rows and its plan row (at the largest K)."""
    rows = [compare.Method("target_only", None, DraftingConfig())]
    for label, drafter, training in drafters:
        own = serving_k(drafter, None)
        ks = sorted({k for k in (cfg.ks or range(1, own + 1)) if k <= drafter.depth}) or [own]
        rows += [compare.Method(f"{label} K={k}", drafter, DraftingConfig(), training, k) for k in ks]
        rows.append(compare.Method(f"{label} plan", drafter, DraftingConfig(plan=True), training, max(ks)))
        if cfg.lookup_tokens:
            rows += [compare.Method(f"{label} K={min(ks)} + lookup", drafter, lookup_drafting(cfg.lookup_tokens),
                                    training, min(ks)),
                     compare.Method(f"{label} plan + lookup", drafter, lookup_drafting(cfg.lookup_tokens, plan=True),
                                    training, max(ks))]
    return rows


def markdown(table: list[dict], drafters: dict) -> str:
    lines = [compare.markdown(table), "", "| drafter | ECE before | ECE after | AUROC | Brier before | Brier after "
             "| temperatures | biases |", "|---|---|---|---|---|---|---|---|"]
    for label, info in drafters.items():
        before, after = info["reliability"]["before"]["all"], info["reliability"]["after"]["all"]
        if not after.get("drafts"):
            continue
        temperatures = " ".join(f"{t:.2f}" for t in info["reliability"]["temperatures"] or []) or "-"
        biases = " ".join(f"{b:.2f}" for b in info["reliability"]["biases"] or []) or "-"
        auroc = "-" if after["auroc"] is None else f"{after['auroc']:.3f}"
        lines.append(f"| {label} | {before['ece']:.3f} | {after['ece']:.3f} | {auroc} | {before['brier']:.3f} "
                     f"| {after['brier']:.3f} | {temperatures} | {biases} |")
    return "\n".join(lines)


def write_tables(label: str, path: str, fitted, target, planner, cfg: PlanningConfig, out: Path) -> None:
    folders = [out / label] + ([Path(path)] if cfg.beside_export else [])
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        if fitted:
            calibration.write_sts(fitted, folder / "sts.json", target)
        planner.costs.write_sps(folder / "sps.json", planner.drafter_ms())


@hydra.main(config_path=str(PROJECT_ROOT / "conf" / "benchmarks"), config_name="planning", version_base="1.3")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    from inference import report
    from inference.planning import make_planner
    from speculators import export

    cfg = to_dataclass(PlanningConfig, cfg)
    out = Path(cfg.out or HydraConfig.get().runtime.output_dir)
    drafters, target = report.load_drafters(cfg.drafters, cfg.target, cfg.quant)
    loaded = list(zip(cfg.drafters, drafters))
    # a run's export by its run's folder (runs/<name>/export), any other export by its own folder
    labels = [Path(path).parent.name if Path(path).name == "export" else Path(path).name or path for path, _ in loaded]
    prompts = [p.ids for p in evalsets.prompts(cfg.eval, target, cfg.max_new_tokens)]
    held_out, timed = prompts[: cfg.calibration_prompts], prompts[cfg.calibration_prompts :]
    if not timed:
        raise UserError(f"eval gives {len(prompts)} prompts, all taken by calibration_prompts="
                        f"{cfg.calibration_prompts}: ask for more (eval.num_prompts) or fewer")
    rows = rows_of([(label, drafter, export.training_record(path)) for label, (path, drafter) in zip(labels, loaded)],
                   cfg)
    fitted = {}
    for label, (_, drafter) in zip(labels, loaded):
        k = max(row.k for row in rows if row.drafter is drafter)
        fitted[label] = calibration.fit_served(target, drafter, k, held_out, cfg.max_new_tokens)
    compare.run(target, rows, timed, cfg)
    table = compare.summary(rows)
    drafters = {}
    for label, (path, drafter) in zip(labels, loaded):
        plan_row = next(row for row in rows if row.drafter is drafter and row.drafting.plan)
        planner = make_planner(target, drafter, plan_row.k, plan_row.drafting)
        write_tables(label, path, fitted[label], target, planner, cfg, out)
        fixed = [figures for row, figures in zip(rows, table) if row.drafter is drafter and not row.drafting.plan
                 and not row.drafting.prompt_lookup_max]
        drafters[label] = {"export": path,
                           "reliability": calibration.before_and_after(plan_row.stats.estimates, fitted[label]),
                           "step_costs_ms": planner.costs.verify_ms, "drafter_ms": planner.drafter_ms(),
                           "per_pass": planner.per_pass,
                           "best_fixed_k": max(fixed, key=lambda r: r["tokens_per_second"])["method"]}
    result = {"rows": table, "drafters": drafters, "target": target.name_or_path, "config": asdict(cfg),
              "git_revision": report.git_revision(), "machine": report.machine()}
    write_result(out, result, markdown(table, drafters), "planning.json", "planning.md")


if __name__ == "__main__":
    run_cli(main)
