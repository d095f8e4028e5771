"""Acceptance report: speculative decoding against target-only decoding on the same prompts.

Writes <out>/report.json (vLLM's metric definitions: tau = 1 + accepted / drafts), <out>/acceptance.png
(acceptance rate per draft position) and prints a table. Baseline and speculative runs are
interleaved batch by batch (`batch_size` prompts decoded together, both ways), so both see the
same machine load. The report has the same keys at every batch size.
"""

import contextlib
import json
import os
import resource
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from common import plots
from common.config import UserError, at_least, require
from common.progress import bar
from common.tracking import LoggerConfig, wandb_mode
from forge_kernels.provenance import git_revision, machine
from inference import calibration
from inference.drafting import DraftingConfig, serving_k
from inference.engine import Stats, check_pair, generate_batch
from inference.evalsets import EvalConfig, Prompt
from speculators.quant import QuantConfig, describe, linear_precision, precision_breakdown
from speculators.self_draft import SELF_DRAFT_TOKENS, SELF_PREFIX, SelfDrafter, check_lower_precision


@dataclass
class InferenceConfig:
    drafter: str = "???"  # an export folder (vLLM speculators format)
    target: str | None = None  # None: the verifier named in the drafter's config
    quant: QuantConfig = field(default_factory=QuantConfig)  # serve the target quantized (quant=int8|int4|fp8|w8a8)
    eval: EvalConfig = field(default_factory=EvalConfig)  # the prompts: eval=stdlib | mtbench | sharegpt | file
    max_new_tokens: int = 64
    temperature: float = 0.0
    k: int | None = None  # chain length K (tree depth with drafting.mode=tree); None: the drafter's own
    drafting: DraftingConfig = field(default_factory=DraftingConfig)
    drafter_quant: str | None = None  # the drafter's linear layers served with this scheme (int8, int4, fp8; none:
    # as trained); null: int8 on a CPU, none on a GPU (speculators.quant.serving_quant)
    batch_size: int = 1  # prompts decoded together (chains only); 1 is the single-sequence fast path
    acceptance_tolerance: float = 0.0  # > 0: typical acceptance of greedy chains (kernels/verify.py), not lossless
    seed: int = 0
    out: str | None = None  # None: the Hydra run directory
    logger: LoggerConfig = field(default_factory=lambda: LoggerConfig(kind="none"))  # kind=wandb to log the report

    def __post_init__(self):
        at_least(0, temperature=self.temperature)
        require(self.k is None or self.k >= 0, "k",
                self.k, ">= 0, or null for the drafter's own")
        at_least(1, max_new_tokens=self.max_new_tokens, batch_size=self.batch_size)
        self.drafting.check_batch(self.batch_size)
        require(0 <= self.seed < 2**32, "seed", self.seed, "in [0, 2**32 - 1], as for training")
        require(0 <= self.acceptance_tolerance < 1, "acceptance_tolerance", self.acceptance_tolerance,
                "in [0, 1) (0: exact greedy verification)")
        if self.out is not None:  # before the target loads and the measurement runs, not after
            from common.files import check_folder_writable

            check_folder_writable(Path(self.out), "out")


def load_pair(drafter_path: str, target_path: str | None = None, quant=None, drafter_quant: str | None = None):
    """(drafter, target) from an export; the target is the verifier its config names unless given, the drafter
    as export.serving makes it (`drafter_quant`). drafter=self:<scheme>: the target's own copy quantized with
    <scheme> drafts (speculators/self_draft.py)."""
    from speculators import export
    from speculators.target import FrozenTarget, TargetConfig, TargetShape

    if drafter_path.startswith(SELF_PREFIX):
        return load_self_pair(drafter_path.removeprefix(SELF_PREFIX), target_path, quant or QuantConfig())
    drafter, verifier = export.load(Path(drafter_path))
    if not (target_path or verifier):
        raise UserError(f"{drafter_path} does not name its target (original EAGLE-3 format); pass target=<path or hub id>")
    target_cfg = TargetConfig.named(target_path or verifier, layer_ids=drafter.layer_ids)
    # The target's config first: another target's sizes are refused before a weight loads, and before its
    # loading refuses the drafter's layer ids without saying whose they are.
    check_trained_for(drafter_path, drafter, TargetShape.read(target_cfg))
    target = FrozenTarget.load(target_cfg, quant or QuantConfig())
    check_trained_for(drafter_path, drafter, target)
    return export.serving(drafter, target, drafter_quant), target


def load_drafters(paths: list[str], target_path: str | None = None, quant=None) -> tuple[list, object]:
    """(drafters, target) for several drafters served against one target (comparisons): the target loaded for
    the first export that reads target layers (else for the first drafter, which may be a self-drafting
    copy), and load_pair's checks for every one. Drafters that read different layers cannot share a target:
    refused in one line."""
    from speculators import export

    drafters = [None if path.startswith(SELF_PREFIX) else export.load(Path(path))[0] for path in paths]
    reading = {tuple(d.layer_ids): path for d, path in zip(drafters, paths) if d is not None and d.layer_ids}
    if len(reading) > 1:
        raise UserError("these drafters read different target layers, which one target cannot serve at once: "
                        + "; ".join(f"{path} {list(ids)}" for ids, path in reading.items())
                        + "; compare them in separate runs")
    first = next((i for i, d in enumerate(drafters) if d is not None and d.layer_ids), 0)
    drafters[first], target = load_pair(paths[first], target_path, quant)
    for i, (drafter, path) in enumerate(zip(drafters, paths)):
        if drafter is None:
            raise UserError(f"drafters: {path} drafts with a copy of the target, which is compared as the first "
                            f"drafter only")
        if i != first:
            check_trained_for(path, drafter, target)
            drafters[i] = export.serving(drafter, target)
    return drafters, target


def load_self_pair(scheme: str, target_path: str | None, quant: QuantConfig):
    """(the target's copy quantized with `scheme` as drafter, the target served with `quant`)."""
    from speculators.target import FrozenTarget, TargetConfig

    if target_path is None:
        raise UserError(f"drafter={SELF_PREFIX}{scheme} drafts with a copy of the target: name it with target=<path or .gguf>")
    target_cfg = TargetConfig.named(target_path, layer_ids=[])
    check_lower_precision(QuantConfig(scheme).scheme, quant.scheme)  # before either loads
    copy = FrozenTarget.load(target_cfg, QuantConfig(scheme))
    return SelfDrafter(copy, scheme, SELF_DRAFT_TOKENS), FrozenTarget.load(target_cfg, quant)


def check_trained_for(drafter_path: str, drafter, target) -> None:
    """Refuse, in one line, a drafter made for another target: the sizes that differ (Drafter.check), which
    a TargetShape tells before the target loads; or, sizes alike, a loaded target's fingerprint other than
    the one its training record names (other weights: the drafts would be rejected without a word)."""
    from speculators import export

    record = export.training_record(Path(drafter_path)) or {}
    trained_for, fingerprint = record.get("target_fingerprint"), target.fingerprint()
    problems = drafter.check(target)
    if not problems and None not in (trained_for, fingerprint) and trained_for != fingerprint:
        problems = [f"fingerprint {trained_for} (drafter) vs {fingerprint} (target)"]
    if problems:
        mismatch = (f"was trained for target {record['target']}, not for target {target.name_or_path}"
                    if record.get("target") else f"does not fit target {target.name_or_path}")
        raise UserError(f"{drafter_path} {mismatch}: " + "; ".join(problems))


def measure(target, drafter, prompts: list[Prompt], cfg: InferenceConfig) -> dict:
    """Baseline and speculative decoding of every prompt, interleaved batch by batch; the report
    as a dict: the figures of all prompts, and the same figures per conversation turn."""
    return measure_arms(target, {"": (drafter, cfg.k)}, prompts, cfg)[""]


def measure_arms(target, arms: dict[str, tuple], prompts: list[Prompt], cfg: InferenceConfig) -> dict[str, dict]:
    """measure() of several (drafter, K) or (drafter, K, DraftingConfig) arms against one baseline: batch by batch,
    target-only decoding, then each arm, so all see the same machine load. name -> report."""
    arms = {name: (arm[0], serving_k(arm[0], arm[1]), arm[2] if len(arm) > 2 else cfg.drafting)
            for name, arm in arms.items()}
    for drafter, k, _ in arms.values():
        if k:
            check_pair(target, drafter)
    if cfg.batch_size > 1 and target.recurrent:
        raise UserError(f"batch_size={cfg.batch_size}: {target.name_or_path} keeps recurrent states, which rejected "
                        f"drafts in a batch would leave gaps in; serve it with batch_size=1")
    turns = sorted({p.turn for p in prompts})
    per_turn = {turn: measure_turn(target, arms, [p for p in prompts if p.turn == turn], cfg) for turn in turns}
    return {name: arm_report(target, {turn: tallies[name] for turn, tallies in per_turn.items()},
                             replace(cfg, k=k, drafting=drafting))
            | {"drafter_linears": linear_precision(drafter) if isinstance(drafter, torch.nn.Module) else None}
            for name, (drafter, k, drafting) in arms.items()}


def arm_report(target, per_turn: dict[int, "Tally"], cfg: InferenceConfig) -> dict:
    """One arm's report: the figures of all its prompts, and the same figures per conversation turn."""
    total = Tally(cfg.k)
    for tally in per_turn.values():
        total.add(tally)
    rows = [row for tally in per_turn.values() for row in tally.rows]
    turns = sorted(per_turn)
    return total.figures() | {
        "per_turn": {str(turn): tally.figures() for turn, tally in per_turn.items()} if len(turns) > 1 else None,
        "peak_memory_mb": peak_memory_mb(),
        "outputs_match_baseline": all(r["matches_baseline"] for r in rows) if cfg.temperature == 0 else None,
        "weights_precision": describe(precision_breakdown(target.model)),
        "estimates": calibration.summary(total.spec.estimates) if total.spec.estimates else None,
        "estimate_pairs": total.spec.estimates if cfg.drafting.plan else None,  # (position, estimate, accepted)
        "drift": drift(target, rows) if cfg.acceptance_tolerance else None,
        "prompts": rows,
        "config": asdict(cfg),
        "target": target.name_or_path,
        "target_layer_ids": target.layer_ids,
        "git_revision": git_revision(),
        "machine": machine(),
        "device": "device_map" if target.placed else str(target.device),  # where the target served
    }


def drift(target, rows: list[dict]) -> dict:
    """What relaxed verification costs: the share of outputs that differ from target-only greedy
    decoding, and the mean log-likelihood per token the target gives each."""
    def log_likelihood(row: dict, key: str) -> torch.Tensor:
        prompt, output = row["prompt_ids"], row[key]
        logits = target(torch.tensor([prompt + output], device=target.device)).logits[0, len(prompt) - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output, device=logits.device)[:, None])[:, 0]

    def per_token(key: str) -> float:
        return float(torch.cat([log_likelihood(row, key) for row in rows]).mean())

    return {"outputs_differing": sum(not r["matches_baseline"] for r in rows) / len(rows),
            "log_likelihood_per_token": per_token("output_ids"),
            "baseline_log_likelihood_per_token": per_token("baseline_output_ids")}


@dataclass
class Tally:
    """Counters of speculative and baseline decoding over some prompts, and their rows."""

    k: int
    spec: Stats = None
    base: Stats = None
    steps: int = 0  # decode steps a request of a batch waits through
    base_steps: int = 0
    batches: int = 0
    rows: list = field(default_factory=list)

    def __post_init__(self):
        self.spec, self.base = self.spec or Stats(self.k), self.base or Stats(0)

    def add_batch(self, target, batch: list[Prompt], base, spec) -> None:
        """One batch decoded target-only (`base`) and speculatively (`spec`)."""
        self.base.add(base.stats)
        self.spec.add(spec.stats)
        self.steps += max(map(len, spec.tokens)) - 1
        self.base_steps += max(map(len, base.tokens)) - 1
        self.batches += 1
        alone = spec.stats.acceptance_length if len(batch) == 1 else None  # a batch's stats are not per prompt
        for prompt, out, baseline in zip(batch, spec.tokens, base.tokens):
            self.rows.append({"prompt": prompt.text, "turn": prompt.turn, "prompt_ids": prompt.ids,
                              "output_ids": out, "output": target.tokenizer.decode(out),
                              "baseline_output_ids": baseline, "matches_baseline": out == baseline,
                              "acceptance_length": alone})

    def add(self, other: "Tally") -> None:
        self.spec.add(other.spec)
        self.base.add(other.base)
        self.steps, self.base_steps = self.steps + other.steps, self.base_steps + other.base_steps
        self.batches += other.batches
        self.rows += other.rows

    def figures(self) -> dict:
        spec, base = self.spec, self.base
        spec_speed = sum(len(r["output_ids"]) for r in self.rows) / (spec.ttft_s + spec.decode_s)
        base_speed = sum(len(r["baseline_output_ids"]) for r in self.rows) / (base.ttft_s + base.decode_s)
        return {
            "acceptance_length": spec.acceptance_length,
            "acceptance_rate_per_position": spec.acceptance_rates,
            "num_prompts": len(self.rows),
            "num_drafts": spec.num_drafts,
            "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens,
            "lookup_drafts": spec.lookup_drafts,  # n-gram lookup chains among the drafts (drafting.prompt_lookup_max)
            "lookup_accepted_tokens": spec.lookup_accepted_tokens,
            "target_forwards": spec.target_forwards,
            "baseline_target_forwards": base.target_forwards,
            "tokens_per_second": spec_speed,
            "baseline_tokens_per_second": base_speed,
            "speedup": spec_speed / base_speed,
            "ttft_s": spec.ttft_s / max(self.batches, 1),  # every prompt of a batch waits for the batch's prefill
            "tpot_s": spec.decode_s / max(self.steps, 1),
            "baseline_tpot_s": base.decode_s / max(self.base_steps, 1),
            "token_latency_ms": percentiles(spec.token_latencies_s),
            "baseline_token_latency_ms": percentiles(base.token_latencies_s),
            "time_split_s": {"draft": spec.draft_s, "verify": spec.verify_s,
                             "other": spec.decode_s - spec.draft_s - spec.verify_s, "first_token": spec.ttft_s},
        }


def percentiles(latencies_s: list[float]) -> dict | None:
    """p50 / p95 / p99 of per-token latencies (engine.Stats.token_latencies_s), in milliseconds."""
    if len(latencies_s) < 2:
        return None
    cuts = statistics.quantiles([s * 1000 for s in latencies_s], n=100, method="inclusive")
    return {"p50": cuts[49], "p95": cuts[94], "p99": cuts[98]}


def measure_turn(target, arms: dict[str, tuple], prompts: list[Prompt], cfg: InferenceConfig) -> dict[str, Tally]:
    """name -> Tally of each (drafter, K) arm; every batch decoded target-only once, then by each arm."""
    size = cfg.batch_size
    tallies = {name: Tally(k) for name, (_, k, _) in arms.items()}
    turn = f" (turn {prompts[0].turn})" if prompts and prompts[0].turn > 1 else ""
    with bar(total=len(prompts) * (1 + len(arms)), unit="decode", desc=f"serving {len(arms)} arms{turn}") as shown:
        for first in range(0, len(prompts), size):  # batch by batch; seed: that of the batch's first prompt
            batch = prompts[first : first + size]
            ids = [p.ids for p in batch]
            base = generate_batch(target, None, ids, cfg.max_new_tokens, 0, cfg.temperature, cfg.seed + first)
            shown.update(len(batch))
            for name, (drafter, k, drafting) in arms.items():
                spec = generate_batch(target, drafter, ids, cfg.max_new_tokens, k, cfg.temperature,
                                      cfg.seed + first, drafting, cfg.acceptance_tolerance)
                tallies[name].add_batch(target, batch, base, spec)
                shown.update(len(batch))
    return tallies


def peak_memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB: the process's peak RSS


def write(report: dict, out_dir: Path) -> Path:
    """report.json and acceptance.png in out_dir, each whole or not at all; the table on the console."""
    from common.files import check_folder_writable, write_atomically

    check_folder_writable(out_dir)  # one line naming it, where a read-only disk would give a traceback
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(out_dir / "report.json", json.dumps(report, indent=2))
    plot_acceptance(report, out_dir / "acceptance.png")
    print(table(report))
    return out_dir / "report.json"


def plot_acceptance(report: dict, path: Path) -> None:
    """The acceptance rate per draft position, drawn into a sibling file renamed over `path`."""
    from common.files import disk_error

    partial = path.with_name(f".{path.stem}.partial{path.suffix}")  # the suffix names the image format
    rates = report["acceptance_rate_per_position"]
    try:
        with plots.figure(partial) as ax:
            ax.plot(range(1, len(rates) + 1), rates, marker="o")
            ax.set(xlabel="draft position i", ylabel="acceptance rate", ylim=(0, 1), xticks=range(1, len(rates) + 1),
                   title=f"acceptance length tau = {report['acceptance_length']:.2f}")
            ax.grid(alpha=0.3)
        os.replace(partial, path)
    except OSError as error:
        raise disk_error(path, error) from None
    finally:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)


def log_to_wandb(report: dict, cfg: LoggerConfig, out_dir: Path) -> None:
    """The report's figures, its acceptance curve and report.json in a W&B run (offline unless configured)."""
    if cfg.kind == "none":
        return
    import wandb

    run = wandb.init(project=cfg.project, name=cfg.name or out_dir.name, dir=str(out_dir), mode=wandb_mode(cfg),
                     config=report["config"], job_type="acceptance-report")
    run.summary.update({key: report[key] for key in ("acceptance_length", "tokens_per_second",
                                                     "baseline_tokens_per_second", "speedup", "outputs_match_baseline")})
    curve = wandb.Table(data=list(enumerate(report["acceptance_rate_per_position"], 1)),
                        columns=["position", "acceptance_rate"])
    run.log({"acceptance_curve": wandb.plot.line(curve, "position", "acceptance_rate", title="acceptance per position")})
    run.save(str(out_dir / "report.json"), base_path=str(out_dir))
    run.finish()


def lookup_line(report: dict) -> str:
    """How the drafts split between n-gram lookup chains and the drafter's (drafting.prompt_lookup_max)."""
    looked_up, drafts = report["lookup_drafts"], report["num_drafts"]
    own = drafts - looked_up
    return (f"  n-gram lookup drafted {looked_up} of {drafts} ({looked_up / drafts:.0%}), tau there "
            f"{1 + report['lookup_accepted_tokens'] / looked_up:.3f}; the drafter's tau "
            f"{1 + (report['num_accepted_tokens'] - report['lookup_accepted_tokens']) / max(own, 1):.3f}")


def table(report: dict) -> str:
    lines = [f"{'position':>8} {'acceptance':>10}"]
    lines += [f"{i:>8} {rate:>10.3f}" for i, rate in enumerate(report["acceptance_rate_per_position"], 1)]
    lines += [
        f"acceptance length tau: {report['acceptance_length']:.3f} over {report['num_drafts']} drafts",
        *([lookup_line(report)] if report["lookup_drafts"] else []),
        *([f"  chains of {report['num_draft_tokens'] / report['num_drafts']:.2f} drafts on average (stopped "
           f"where the drafter's top probability fell below drafting.chain_min_prob={min_prob})"]
          if (min_prob := report["config"]["drafting"]["chain_min_prob"]) else []),
        *([f"  planned: {report['num_draft_tokens'] / report['num_drafts']:.2f} drafts verified on average of K="
           f"{report['config']['k']}; estimates ECE {report['estimates']['all']['ece']:.3f}, Brier "
           f"{report['estimates']['all']['brier']:.3f}"] if report["config"]["drafting"].get("plan")
          and report.get("estimates") else []),
        *[f"  turn {turn}: tau {figures['acceptance_length']:.3f}, speed-up {figures['speedup']:.2f}x "
          f"({figures['num_prompts']} prompts)" for turn, figures in (report["per_turn"] or {}).items()],
        f"tokens/s: {report['tokens_per_second']:.1f} speculative vs {report['baseline_tokens_per_second']:.1f} "
        f"target-only (speed-up {report['speedup']:.2f}x)",
        "decode time: " + ", ".join(f"{name} {secs:.2f}s" for name, secs in report["time_split_s"].items()),
        *([f"typical acceptance (tolerance {report['config']['acceptance_tolerance']}): "
           f"{report['drift']['outputs_differing']:.0%} of outputs differ from target-only greedy; log-likelihood "
           f"per token {report['drift']['log_likelihood_per_token']:.3f} vs "
           f"{report['drift']['baseline_log_likelihood_per_token']:.3f}"] if report.get("drift") else []),
        *([f"target weights: {report['weights_precision']}"]
          if report.get("weights_precision") and report["config"]["quant"]["scheme"] != "none" else []),
        *([f"drafter's linear layers served in {report['drafter_linears']}"] if report.get("drafter_linears") else []),
        f"outputs match target-only greedy: {report['outputs_match_baseline']}" + (
            " (w8a8 rounds activations, which amplifies last-bit differences between a 1-token and a "
            "(k+1)-token forward: lossless in distribution, not always token for token)"
            if report["outputs_match_baseline"] is False and report["config"]["quant"]["scheme"] == "w8a8" else ""),
    ]
    return "\n".join(lines)
