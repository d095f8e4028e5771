"""Cost-aware verification: verify the prefix of a draft that maximizes expected tokens per second.

A cycle that verifies n drafts costs the drafter's time for them plus one target pass over n + 1 tokens (the
root and the drafts), and yields 1 + sum_{j<=n} s_j tokens on average, where s_j = c_1 ... c_j is the chance
that drafts 1..j all survive and c_j the acceptance estimate of draft j given the ones before it (DSpark's
confidence head; a drafter's top probability otherwise), both after calibration (`Calibration`: per-position
temperatures, TensorRT-LLM's sts.json, and biases; fitted by inference/calibration.py). An n-gram lookup's chain
(inference/lookup.py) brings its own counted estimates and costs the verify pass alone. The planner picks n with
the highest expected tokens per second:

- `best_length(c)`: all estimates known before any draft is kept (one-pass drafters, and greedy DSpark): the
  global argmax over n, as TensorRT-LLM's planner takes it (the cost is a staircase, so the first drop is not
  the maximum).
- `keep_going(c_1..c_j)`: drafts decided one at a time from estimates that depend only on the drafts before
  them (EAGLE chains, Medusa's heads, sampled DSpark): continue while some n >= j, with the later estimates
  forecast as c_j, beats stopping at j - 1. A stopping rule of that kind never looks at the draft it decides on,
  so sampled verification stays lossless; greedy verification is exact whatever is verified.

Verification itself is unchanged: the planner only decides how much is verified, never what is accepted.

Costs come from the machine: `measure_target` times target passes over 1..N tokens after a prompt-sized
context (cached per target, quant and machine: StepCosts.cached), the drafter's cost per draft (a chain step)
or per pass (a block) is the engine's own running median of what it spent.
"""

import hashlib
import json
import math
import os
import platform
import statistics
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from common.config import UserError
from common.files import cache_root
from inference.sessions import open_session


def machine() -> str:
    """What a step cost depends on besides the target: the processor, threads, torch build and device."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return f"{cpu} | {torch.get_num_threads()} threads | torch {torch.__version__} | {device}"


@dataclass
class StepCosts:
    """Milliseconds of a target pass over n tokens after `context` cached ones, n = 1..len(verify_ms)."""

    verify_ms: list[float]
    context: int
    target: str  # the target and quant it was measured with
    machine: str

    def verify(self, tokens: int) -> float:
        """A pass over `tokens` tokens; beyond the table, its last slope."""
        table = self.verify_ms
        if tokens <= len(table):
            return table[tokens - 1]
        slope = table[-1] - table[-2] if len(table) > 1 else table[-1]
        return table[-1] + slope * (tokens - len(table))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(asdict(self), indent=1))
        os.replace(partial, path)

    def write_sps(self, path: Path, draft_ms: float = 0.0) -> None:
        """TensorRT-LLM's confidence_sps_table_path layout: step time by verified tokens (the bonus included)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"token_counts": list(range(1, len(self.verify_ms) + 1)),
                                    "step_time_ms": [round(ms, 4) for ms in self.verify_ms],
                                    "fixed_overhead_ms": round(draft_ms, 4),
                                    "machine": self.machine, "target": self.target}, indent=1))

    @classmethod
    def read(cls, path: Path, target: str) -> "StepCosts | None":
        """A table measured for `target` on this machine; None (and one line saying why) otherwise."""
        try:
            costs = cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as e:
            print(f"step-cost table {path} unreadable ({type(e).__name__}): measuring again")
            return None
        for what, theirs, ours in (("machine", costs.machine, machine()), ("target", costs.target, target)):
            if theirs != ours:
                print(f"step-cost table {path} was measured for {what} {theirs!r}, not {ours!r}: measuring again")
                return None
        return costs

    @classmethod
    def cached(cls, session_factory, target_key: str, tokens: int, context: int, path: str | None = None,
               remeasure: bool = False) -> "StepCosts":
        """The table for this target on this machine: read from `path` (default: the cache), else measured."""
        file = Path(path) if path else cache_root() / "step_costs" / f"{hashlib.sha256(f'{target_key}|{machine()}'.encode()).hexdigest()[:16]}.json"
        costs = None if remeasure or not file.exists() else cls.read(file, target_key)
        if costs is None or len(costs.verify_ms) < tokens:
            print(f"measuring the target's step cost for 1..{tokens} tokens on this machine ({file})")
            costs = measure_target(session_factory, target_key, tokens, context)
            costs.save(file)
        return costs


def measure_target(session_factory, target_key: str, tokens: int, context: int, repeats: int = 5) -> StepCosts:
    """Median time of a target pass over n = 1..tokens tokens after `context` cached ones, interleaved."""
    session = session_factory(context + tokens + 1)
    device = session.target.device
    session(torch.zeros(1, context, dtype=torch.long, device=device))
    times: dict[int, list[float]] = {n: [] for n in range(1, tokens + 1)}
    for _ in range(repeats + 1):  # the first round warms up
        for n in times:
            started = time.perf_counter()
            session(torch.zeros(1, n, dtype=torch.long, device=device))
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[n].append(time.perf_counter() - started)
            session.crop(context)
    return StepCosts([1000 * statistics.median(t[1:]) for t in times.values()], context, target_key, machine())


def sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-max(min(z, 50.0), -50.0)))


@dataclass
class Calibration:
    """Per-position temperatures and biases of acceptance estimates, c = sigmoid(z / T_j + b_j) for an estimate
    of logit z at draft position j (fitted by inference/calibration.py); positions past the lists take the last."""

    temperatures: list[float]
    biases: list[float]

    def at(self, position: int) -> tuple[float, float]:
        i = min(position, len(self.temperatures)) - 1
        return self.temperatures[i], self.biases[i]

    def estimate(self, position: int, z: float) -> float:
        """The calibrated chance that draft `position` (1-based) is accepted, from its raw logit z."""
        t, b = self.at(position)
        return sigmoid(z / t + b)

    def raw(self, position: int, estimate: float) -> float:
        """The raw estimate a calibrated one came from."""
        t, b = self.at(position)
        return sigmoid((logit(estimate) - b) * t)


@dataclass
class Planner:
    """Chooses how many drafts a cycle verifies (module doc). `per_pass`: the drafter's cost is one pass
    whatever is verified (blocks, P-EAGLE), else one step per draft (chains, Medusa's heads)."""

    costs: StepCosts
    per_pass: bool
    calibration: Calibration | None = None  # per draft position, applied to the estimate's logit
    draft_ms: list[float] = field(default_factory=list)  # the last 16 drafter times, per pass or per draft
    trims: bool = True  # False: estimates are recorded, every draft up to K is verified (calibration passes)

    def calibrated(self, position: int, logit: float) -> float:
        """The acceptance estimate of draft `position` (1-based) from its raw logit."""
        return self.calibration.estimate(position, logit) if self.calibration else sigmoid(logit)

    def drafter_ms(self) -> float:
        return statistics.median(self.draft_ms) if self.draft_ms else 0.0

    def record_draft(self, seconds: float, drafts: int) -> None:
        """What the drafter spent on a cycle's `drafts` drafts (per_pass: on its one pass)."""
        if self.per_pass or drafts:
            self.draft_ms = self.draft_ms[-15:] + [1000 * seconds / (1 if self.per_pass else drafts)]

    def cost(self, n: int, spent: int = 0, looked_up: bool = False) -> float:
        """A cycle verifying n drafts, of which the drafter has already drafted `spent` (a chain's steps and
        Medusa's heads are paid whether or not their drafts are verified); an n-gram lookup's drafts cost the
        drafter nothing."""
        draft = 0.0 if looked_up else self.drafter_ms() * (1 if self.per_pass else max(n, spent))
        return draft + self.costs.verify(n + 1)

    def rates(self, estimates: list[float], spent: int = 0, looked_up: bool = False) -> list[float]:
        """Expected tokens per millisecond of verifying n = 0..len(estimates) drafts."""
        rates, survival, expected = [1 / self.cost(0, spent, looked_up)], 1.0, 1.0
        for n, c in enumerate(estimates, 1):
            survival *= c
            expected += survival
            rates.append(expected / self.cost(n, spent, looked_up))
        return rates

    def best_length(self, estimates: list[float], looked_up: bool = False) -> int:
        """The n in 0..len(estimates) with the highest expected tokens per millisecond (ties: the shorter)."""
        if not self.trims:
            return len(estimates)
        rates = self.rates(estimates, looked_up=looked_up)
        return max(range(len(rates)), key=lambda n: (rates[n], -n))

    def worth_drafting(self, estimates: list[float], limit: int) -> bool:
        """Before paying for the next draft of a chain decided one draft at a time: whether it could be worth
        verifying if it were as likely as the last one (the first draft always is)."""
        return not estimates or self.keep_going(estimates + estimates[-1:], limit, spent=len(estimates))

    def worth_verifying(self, estimates: list[float], limit: int) -> bool:
        """After paying for draft j (its estimate last in `estimates`): whether it is verified."""
        return len(estimates) == 1 or self.keep_going(estimates, limit, spent=len(estimates))

    def keep_going(self, estimates: list[float], limit: int, spent: int = 0) -> bool:
        """Whether draft j = len(estimates) is worth verifying, with drafts j+1..limit forecast at c_j and `spent`
        drafts already paid for."""
        if not self.trims:
            return True
        j = len(estimates)
        forecast = estimates + [estimates[-1]] * (limit - j)
        rates = self.rates(forecast, spent)
        return max(rates[j:]) > rates[j - 1]


def logit(p: float) -> float:
    """The logit of a probability, kept finite."""
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


def read_calibration(path: Path, fingerprint: str) -> Calibration:
    """Per-position temperatures (TensorRT-LLM's and SGLang's keys) and biases (ours; 0 where absent) from an
    sts.json fitted for the target with this weights fingerprint (a file that names another target is refused)."""
    try:
        data = json.loads(Path(path).read_text())
        temperatures = [float(t) for t in data.get("sts_temperatures", data.get("temperatures"))]
        biases = [float(b) for b in data.get("sts_biases", [0.0] * len(temperatures))]
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise UserError(f"{path}: not a calibration file ({type(e).__name__}); expected "
                        f'{{"sts_temperatures": [T_1, ..., T_K]}}') from None
    if not temperatures or min(temperatures) <= 0:
        raise UserError(f"{path}: sts_temperatures must be a non-empty list of positive numbers")
    if len(biases) != len(temperatures) or not all(math.isfinite(b) for b in biases):
        raise UserError(f"{path}: sts_biases must be {len(temperatures)} finite numbers, one per temperature")
    if data.get("target_fingerprint") not in (None, fingerprint):
        raise UserError(f"{path} was fitted for another target (weights fingerprint {data['target_fingerprint']}, "
                        f"this one's {fingerprint}): refit it with python -m benchmarks.planning, or pass "
                        f"drafting.calibration=<its own sts.json>")
    return Calibration(temperatures, biases)


def target_key(target) -> str:
    """The target as its step cost knows it: its weights and how its layers compute (the quant scheme)."""
    kinds = sorted({type(m).__name__ for m in target.model.modules()})
    return f"{target.name_or_path} | {target.fingerprint()} | {next(target.model.parameters()).dtype} | " \
           f"{hashlib.sha256(' '.join(kinds).encode()).hexdigest()[:8]}"


_PLANNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # drafter -> {settings: Planner}


def make_planner(target, drafter, k: int, drafting) -> Planner:
    """The planner for serving `drafter` with `target` at K=k: one per pair and settings, so the drafter's
    running cost carries over from prompt to prompt. Its step costs reach the longest draft verified: K, or
    an n-gram lookup's chain."""
    settings = (id(target), k, drafting.cost_table, drafting.calibration)
    planners = _PLANNERS.setdefault(drafter, {})
    widest = max(k, drafting.lookup_length(k))
    planner = None if drafting.remeasure else planners.get(settings)
    if planner is None or len(planner.costs.verify_ms) <= widest:
        context = min(256, target.config.max_position_embeddings - widest - 2)
        costs = StepCosts.cached(lambda n: open_session(target, n), target_key(target), widest + 1, context,
                                 drafting.cost_table, drafting.remeasure)
        if planner is not None:  # the same drafter and K with lookup's longer chains: its calibration kept
            planner.costs = costs
            return planner
        file = drafting.calibration or drafter.calibration_file
        calibration = read_calibration(Path(file), target.fingerprint()) if file else None
        # Chains draft one step, and Medusa one head, per draft; the others one pass whatever is verified.
        planners[settings] = Planner(costs, per_pass=drafter.drafting_kind not in ("autoregressive", "heads"),
                                     calibration=calibration)
    return planners[settings]
