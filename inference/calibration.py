"""How far a drafter's acceptance estimates can be trusted, and per-position scaling that fixes them.

The planner (inference/planning.py) multiplies estimates along a draft, so a bias per position compounds over
the block. From served drafts (engine.Stats.estimates: position, estimate, accepted) this module measures
reliability per position and over all (ECE over 10 equal-width bins, AUROC, Brier score) and fits, per position j,
c = sigmoid(z / T_j + b_j) for an estimate of logit z, by minimizing the log loss on those drafts:
- T_j, the temperature: TensorRT-LLM's and SGLang's STS (sts.json, {"sts_temperatures": [T_1, ..., T_K]}). A
  position with too few accepted or rejected drafts takes the temperature fitted on all of them (a grid end would
  scale it to 0 or 1).
- b_j, a bias fitted after T_j (sts.json's "sts_biases", ours; engines that read only the temperatures skip it):
  a temperature pivots at 1/2, so estimates too high on both sides of 1/2 (Medusa's heads, EAGLE's later
  positions) cannot all be lowered by one. A weak prior (one pseudo-draft's curvature at b = 0) keeps a position
  never accepted in the calibration prompts at a low estimate, not 0; a position never served takes the bias of
  the one before it.
"""

import json
from pathlib import Path

import torch

from inference.planning import Calibration, logit, make_planner

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


def fit_temperature(estimates: list[float], outcomes: list[bool]) -> float:
    """The temperature of the grid with the lowest log loss on these drafts (1 where there are none)."""
    if not estimates:
        return 1.0
    z, y = torch.tensor([logit(e) for e in estimates], dtype=torch.float64), torch.tensor(outcomes).double()
    losses = [float(torch.nn.functional.binary_cross_entropy_with_logits(z / t, y)) for t in GRID]
    return GRID[min(range(len(GRID)), key=losses.__getitem__)]


def fit_bias(estimates: list[float], outcomes: list[bool], temperature: float) -> float:
    """The b minimizing the log loss of sigmoid(z / T + b) on these drafts plus b^2 / 2 (the prior): Newton steps
    on a convex function of one variable."""
    z = torch.tensor([logit(e) for e in estimates], dtype=torch.float64) / temperature
    y, b = torch.tensor(outcomes).double(), 0.0
    for _ in range(50):
        p = torch.sigmoid(z + b)
        step = (float((p - y).sum()) + b) / (float((p * (1 - p)).sum()) + 1.0)
        b -= max(min(step, 5.0), -5.0)
        if abs(step) < 1e-9:
            break
    return b


def fit(pairs: list[tuple[int, float, bool]], depth: int) -> Calibration:
    """Per-position temperatures and biases 1..depth (module doc). A position needs MIN_EACH accepted and MIN_EACH
    rejected drafts for a temperature of its own: with fewer, the log loss is least at a grid end (a position
    never accepted in the calibration prompts would be scaled to 0 and never verified again), so it takes the
    one temperature fitted on every draft, or 1 where even those are too few; its bias is fitted on its own
    drafts, under the prior."""
    positions = by_position(pairs)
    everything = ([e for _, e, _ in pairs], [ok for _, _, ok in pairs])
    shared = fit_temperature(*everything) if enough(everything[1]) else 1.0
    temperatures = [fit_temperature(*positions[position]) if position in positions and enough(positions[position][1])
                    else shared for position in range(1, depth + 1)]
    biases, bias = [], 0.0
    for position, temperature in enumerate(temperatures, 1):
        if position in positions:
            bias = fit_bias(*positions[position], temperature)
        biases.append(bias)
    return Calibration(temperatures, biases)


def enough(outcomes: list[bool]) -> bool:
    accepted = sum(outcomes)
    return min(accepted, len(outcomes) - accepted) >= MIN_EACH


def apply(pairs: list[tuple[int, float, bool]], calibration: Calibration) -> list[tuple[int, float, bool]]:
    return [(pos, calibration.estimate(pos, logit(e)), ok) for pos, e, ok in pairs]


def summary(pairs: list[tuple[int, float, bool]]) -> dict:
    """Reliability over all drafts and per position."""
    positions = by_position(pairs)
    return {"all": reliability([e for _, e, _ in pairs], [ok for _, _, ok in pairs]),
            "per_position": {str(pos): reliability(*positions[pos]) for pos in positions}}


def write_sts(calibration: Calibration, path: Path, target) -> None:
    """TensorRT-LLM's confidence_sts_path layout, our biases beside it, and the target it was fitted for
    (planning.read_calibration)."""
    path.write_text(json.dumps({"sts_temperatures": [round(t, 5) for t in calibration.temperatures],
                                "sts_biases": [round(b, 5) for b in calibration.biases],
                                "target": target.name_or_path, "target_fingerprint": target.fingerprint()},
                               indent=1) + "\n")


def fit_served(target, drafter, k: int, prompts: list[list[int]], max_new_tokens: int) -> Calibration | None:
    """The calibration of `drafter`'s estimates from serving `prompts` with every draft up to K verified (a plan
    that does not trim); the planner serving it next (drafting.plan) applies it. None without prompts."""
    from inference.drafting import DraftingConfig
    from inference.engine import Stats, generate

    if not prompts:
        return None
    drafting = DraftingConfig(plan=True)
    planner = make_planner(target, drafter, k, drafting)
    planner.trims, planner.calibration = False, None
    stats = Stats(k)
    for ids in prompts:
        stats.add(generate(target, drafter, ids, max_new_tokens, k, drafting=drafting).stats)
    planner.trims, planner.calibration = True, fit(stats.estimates, k)
    return planner.calibration


def before_and_after(pairs: list[tuple[int, float, bool]], calibration: Calibration | None) -> dict:
    """Reliability of estimates served after `calibration` (`pairs`), and of the same drafts' raw estimates."""
    before = [(pos, calibration.raw(pos, e), ok) for pos, e, ok in pairs] if calibration else pairs
    return {"before": summary(before), "after": summary(pairs),
            "temperatures": calibration.temperatures if calibration else None,
            "biases": calibration.biases if calibration else None}
