"""Train/serve parity: does an export, loaded as a serving engine loads it, accept what training measured?

    python -m benchmarks.parity drafter=<run>/export [reference=<run>/acceptance/report.json] [target=...]

The reference is the acceptance report the training run wrote with its in-memory drafter
(by default the one beside the export). The export is loaded from disk and served by the
bundled engine on exactly the reference's prompt ids, K, temperature and seed. Greedy
decoding is deterministic, so tau must agree up to float noise; a larger gap is an error
that names the likely cause, checked in order: another target, other feature layers, the
norm_before_residual flag (the classic silent mismatch: vLLM assumes true when it is
absent), and otherwise weights that differ from the ones trained.
"""

import json
from dataclasses import dataclass, replace
from pathlib import Path

import hydra
from omegaconf import DictConfig

from common.config import PROJECT_ROOT, UserError, exit_on_user_error, run_cli, to_dataclass

TOLERANCE = 0.02  # relative tau gap allowed: near-tie argmaxes may flip under float reordering


@dataclass
class ParityConfig:
    drafter: str = "???"  # an export folder
    reference: str | None = None  # None: <export>/../acceptance/report.json
    target: str | None = None  # None: the reference report's target


def served_tau(target, drafter, reference: dict) -> float:
    from inference.drafting import DraftingConfig
    from inference.engine import Stats, generate

    cfg = reference["config"]
    drafting = DraftingConfig(**cfg.get("drafting", {}))
    stats = Stats(cfg["k"])
    for i, row in enumerate(reference["prompts"]):
        stats.add(generate(target, drafter, row["prompt_ids"], cfg["max_new_tokens"], cfg["k"],
                           cfg["temperature"], cfg["seed"] + i, drafting).stats)
    return stats.acceptance_length


def likely_cause(target, drafter, reference: dict) -> str:
    if reference.get("target") not in (None, target.name_or_path):
        return f"served with target {target.name_or_path}, trained against {reference['target']}"
    trained_layers = reference.get("target_layer_ids")
    if trained_layers is not None and trained_layers != drafter.layer_ids:
        return f"the export reads target layers {drafter.layer_ids}, training used {trained_layers}"
    if hasattr(getattr(drafter, "cfg", None), "norm_before_residual"):
        flipped = replace(drafter.cfg, norm_before_residual=not drafter.cfg.norm_before_residual)
        original = drafter.cfg
        drafter.cfg = flipped
        for layer in drafter.layers:
            layer.norm_before_residual = flipped.norm_before_residual
        try:
            if agrees(served_tau(target, drafter, reference), reference["acceptance_length"]):
                return (f"norm_before_residual is {original.norm_before_residual} in the export; the drafter was "
                        f"trained with {flipped.norm_before_residual}")
        finally:
            drafter.cfg = original
            for layer in drafter.layers:
                layer.norm_before_residual = original.norm_before_residual
    return "the exported weights or draft vocabulary differ from the drafter that was measured in training"


def agrees(tau: float, reference_tau: float) -> bool:
    return abs(tau - reference_tau) <= TOLERANCE * reference_tau


def check(drafter_path: str, reference_path: str | None = None, target_path: str | None = None) -> dict:
    from inference import report

    if not Path(drafter_path).is_dir():
        raise UserError(f"drafter={drafter_path}: no such export folder")
    reference_path = Path(reference_path or Path(drafter_path).parent / "acceptance" / "report.json")
    if not reference_path.is_file():
        raise UserError(f"no reference report at {reference_path}; pass reference=<report.json written in training>")
    reference = json.loads(reference_path.read_text())
    drafter, target = report.load_pair(drafter_path, target_path or reference.get("target"))
    tau = served_tau(target, drafter, reference)
    result = {"served_tau": tau, "reference_tau": reference["acceptance_length"], "reference": str(reference_path)}
    if not agrees(tau, reference["acceptance_length"]):
        raise UserError(f"parity check failed: served tau {tau:.3f} vs {reference['acceptance_length']:.3f} in "
                        f"training; likely cause: {likely_cause(target, drafter, reference)}")
    return result


@hydra.main(config_path=str(PROJECT_ROOT / "conf" / "benchmarks"), config_name="parity", version_base="1.3")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    cfg = to_dataclass(ParityConfig, cfg)
    result = check(cfg.drafter, cfg.reference, cfg.target)
    print(f"parity: served tau {result['served_tau']:.3f} = {result['reference_tau']:.3f} in training "
          f"(within {TOLERANCE:.0%})")


if __name__ == "__main__":
    run_cli(main)
