"""How far a drafter's acceptance estimates can be trusted, and per-position temperature scaling that fixes them.

The planner (inference/planning.py) multiplies estimates along a draft, so a bias per position compounds over
the block. From served drafts (engine.Stats.estimates: position, estimate, accepted) this module measures
reliability per position and over all (ECE over 10 equal-width bins, AUROC, Brier score) and fits one
temperature per position, c = sigmoid(logit / T), by minimizing the log loss on those drafts (a position with
too few accepted or rejected drafts takes the temperature fitted on all of them): TensorRT-LLM's and SGLang's
STS (sts.json, {"sts_temperatures": [T_1, ..., T_K]}), which the planner reads back.
"""

import json
import math
from pathlib import Path

import torch

GRID = torch.logspace(-1.5, 1.5, 121).tolist()  # temperatures tried, 0.03 to 32
MIN_EACH = 20  # accepted and rejected drafts a position needs to be fitted on its own


def reliability(estimates: list[float], outcomes: list[bool], bins: int = 10) -> dict:
    """ECE, AUROC and Brier score of estimates against what happened; the mean of each."""
    if not estimates:
        return {"drafts": 0}
    p, y = torch.tensor(estimates, dtype=torch.float64), torch.tensor(outcomes, dtype=torch.float64)
    which = (p * bins).long().clamp(max=bins - 1)
    ece = sum(float((which == b).sum()) / len(p) * abs(float(p[which == b].mean() - y[which == b].mean()))
              for b in range(bins) if bool((which == b).any()))
    return {"drafts": len(p), "mean_estimate": float(p.mean()), "accepted_rate": float(y.mean()), "ece": ece,
            "brier": float(((p - y) ** 2).mean()), "auroc": auroc(p, y)}


def auroc(p: torch.Tensor, y: torch.Tensor) -> float | None:
    """The chance that an accepted draft was estimated higher than a rejected one (ties count half)."""
    positive, negative = p[y == 1], p[y == 0]
    if not len(positive) or not len(negative):
        return None
    greater = (positive[:, None] > negative[None, :]).double().mean()
    ties = (positive[:, None] == negative[None, :]).double().mean()
    return float(greater + 0.5 * ties)


def by_position(pairs: list[tuple[int, float, bool]]) -> dict[int, tuple[list[float], list[bool]]]:
    positions: dict[int, tuple[list[float], list[bool]]] = {}
    for position, estimate, accepted in pairs:
        estimates, outcomes = positions.setdefault(position, ([], []))
        estimates.append(estimate)
        outcomes.append(accepted)
    return dict(sorted(positions.items()))


def logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


def scaled(estimate: float, temperature: float) -> float:
    """An estimate after temperature scaling of its logit."""
    return 1 / (1 + math.exp(-max(min(logit(estimate) / temperature, 50.0), -50.0)))


def fit_temperature(estimates: list[float], outcomes: list[bool]) -> float:
    """The temperature of the grid with the lowest log loss on these drafts (1 where there are none)."""
    if not estimates:
        return 1.0
    z, y = torch.tensor([logit(e) for e in estimates], dtype=torch.float64), torch.tensor(outcomes).double()
    losses = [float(torch.nn.functional.binary_cross_entropy_with_logits(z / t, y)) for t in GRID]
    return GRID[min(range(len(GRID)), key=losses.__getitem__)]


def fit(pairs: list[tuple[int, float, bool]], depth: int) -> list[float]:
    """Per-position temperatures 1..depth. A position needs MIN_EACH accepted and MIN_EACH rejected drafts for a
    temperature of its own: with fewer, the log loss is least at a grid end (a position never accepted in the
    calibration prompts would be scaled to 0 and never verified again), so it takes the one temperature fitted
    on every draft, or 1 where even those are too few."""
    positions = by_position(pairs)
    everything = ([e for _, e, _ in pairs], [ok for _, _, ok in pairs])
    shared = fit_temperature(*everything) if enough(everything[1]) else 1.0
    return [fit_temperature(*positions[position]) if position in positions and enough(positions[position][1])
            else shared for position in range(1, depth + 1)]


def enough(outcomes: list[bool]) -> bool:
    accepted = sum(outcomes)
    return min(accepted, len(outcomes) - accepted) >= MIN_EACH


def apply(pairs: list[tuple[int, float, bool]], temperatures: list[float]) -> list[tuple[int, float, bool]]:
    return [(pos, scaled(e, temperatures[min(pos, len(temperatures)) - 1]), ok) for pos, e, ok in pairs]


def summary(pairs: list[tuple[int, float, bool]]) -> dict:
    """Reliability over all drafts and per position."""
    positions = by_position(pairs)
    return {"all": reliability([e for _, e, _ in pairs], [ok for _, _, ok in pairs]),
            "per_position": {str(pos): reliability(*positions[pos]) for pos in positions}}


def write_sts(temperatures: list[float], path: Path, target) -> None:
    """TensorRT-LLM's confidence_sts_path layout, and the target it was fitted for (planning.read_temperatures)."""
    path.write_text(json.dumps({"sts_temperatures": [round(t, 5) for t in temperatures],
                                "target": target.name_or_path, "target_fingerprint": target.fingerprint()},
                               indent=1) + "\n")


def fit_served(target, drafter, k: int, prompts: list[list[int]], max_new_tokens: int) -> list[float] | None:
    """Per-position temperatures of `drafter`'s estimates from serving `prompts` with every draft up to K verified
    (a plan that does not trim); the planner serving it next (drafting.plan) scales by them. None without prompts."""
    from inference.drafting import DraftingConfig
    from inference.engine import Stats, generate
    from inference.planning import make_planner

    if not prompts:
        return None
    drafting = DraftingConfig(plan=True)
    planner = make_planner(target, drafter, k, drafting)
    planner.trims, planner.temperatures = False, None
    stats = Stats(k)
    for ids in prompts:
        stats.add(generate(target, drafter, ids, max_new_tokens, k, drafting=drafting).stats)
    planner.trims, planner.temperatures = True, fit(stats.estimates, k)
    return planner.temperatures


def before_and_after(pairs: list[tuple[int, float, bool]], temperatures: list[float] | None) -> dict:
    """Reliability of estimates served after scaling by `temperatures` (`pairs`), and of the same drafts' raw
    estimates before it."""
    before = apply(pairs, [1 / t for t in temperatures]) if temperatures else pairs
    return {"before": summary(before), "after": summary(pairs), "temperatures": temperatures}
