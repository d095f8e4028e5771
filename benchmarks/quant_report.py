"""The quantization report: four ways to serve a target, measured side by side on the same prompts.

    python -m benchmarks.quant_report drafter=<export> [quantized_drafters={int4:<export>,int8:<export>}]
        [schemes=[int8,int4]] [target=<dir>] [eval=stdlib|mtbench|sharegpt|file eval.path=<jsonl>]
        [self_drafts={none:gguf,int8:gguf}] [max_new_tokens=64] [k=K] [repeats=3] [out=DIR]

For each quantization scheme s, the production rollout's four steps:
    baseline           full-precision target, no drafter
    quantization only  the target quantized with s, no drafter
    speculation only   full-precision target + `drafter` (trained against the full-precision target)
    both               quantized target + quantized_drafters.s (trained against it) if given, else `drafter`
Columns: the target's weight bytes; decode tokens/s (tokens after the first / time after the
first token, median over repeats); speed-up over the baseline; tau = 1 + accepted / drafts (vLLM's
acceptance length); and output drift against the full-precision target's greedy output y:
- greedy agreement = sum_i m_i / sum_i |y_i|, with m_i the length of output i's prefix equal to y_i
  (positions after the first difference count as different: their contexts differ); and mean m_i;
- mean KL(p_fp || p_s) of next-token distributions over the positions of y, both targets
  teacher-forced on prompt + y: the same contexts, so it is defined even where outputs diverge;
- with a drafter: the share of prompts whose output equals the same target's output alone (1 for
  every weight-only scheme: greedy speculation is lossless; w8a8 can fall short, speculators/quant/__init__.py).
A target converted from a GGUF file is that file's weights, dequantized: a drafter trained against
quant=gguf serves it as `drafter` (trained against the same weights).
Quantized self-speculation (speculators/self_draft.py): self_drafts maps a target ("none": the
full-precision one) to a lower-precision scheme of the report whose copy drafts for it,
self_draft_tokens at a time; its table sets it beside that target alone and with `drafter`.
The cross table: tau of `drafter` and of quantized_drafters.s, each served with the s target, beside
tau of `drafter` on the full-precision target. Every drafter drafts K = k tokens,
or its own K (the depth it was trained for) when that is null.

Every way of serving decodes a prompt before any starts the next one (interleaved: all see the same
machine load), in each of `repeats` repeats, greedily. Writes <out>/quant_report.json (everything,
with the config, git revision and machine) and <out>/quant_report.md (the tables, for the README).
"""

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from benchmarks.quant_bench import decode_ways, linear_ops, prefix_match, quant_error
from benchmarks.tables import write_result
from common import plots
from common.config import (
    PROJECT_ROOT,
    UserError,
    at_least,
    exit_on_user_error,
    one_of,
    require,
    run_cli,
    to_dataclass,
)
from inference import evalsets, report
from inference.drafting import DraftingConfig, serving_k
from inference.engine import check_pair
from inference.evalsets import EvalConfig, Prompt
from speculators import export
from speculators.quant import QUANT_SCHEMES, QuantConfig, weight_bytes
from speculators.self_draft import SELF_DRAFT_TOKENS, SelfDrafter, check_lower_precision
from speculators.self_draft import SELF_PREFIX as SELF  # drafter key of a self-drafting copy: self:<scheme>
from speculators.target import FrozenTarget, TargetConfig

FULL = "fp"  # the full-precision target, and the drafter trained against it
STEPS = {"baseline": "baseline", "quantization_only": "quantization only", "speculation_only": "speculation only",
         "both": "both"}



@dataclass
class QuantReportConfig:
    drafter: str = "???"  # export of a drafter trained against the full-precision target
    quantized_drafters: dict[str, str] | None = None  # scheme -> export trained against that quantized target
    target: str = str(PROJECT_ROOT / "models" / "pycode")
    schemes: list[str] = field(default_factory=lambda: ["int8", "int4"])
    group_size: int = 32  # as speculators.quant.QuantConfig, for every scheme
    quantize_embeddings: bool = False
    quantize_lm_head: bool = False
    cpu_matmul: str = "kernel"  # kernel | dequantize | packed, as speculators.quant.QuantConfig
    eval: EvalConfig = field(default_factory=EvalConfig)  # the prompts: eval=stdlib | mtbench | sharegpt | file
    self_drafts: dict[str, str] | None = None  # target scheme (none: full precision) -> the scheme of its drafting copy
    self_draft_tokens: int = SELF_DRAFT_TOKENS  # K of the self-drafting copies (they have no trained depth)
    max_new_tokens: int = 64
    k: int | None = None  # K for every drafter; None: each drafter's own
    drafting: DraftingConfig = field(default_factory=DraftingConfig)
    repeats: int = 3
    out: str | None = None  # None: the Hydra run directory

    def __post_init__(self):
        require(bool(self.schemes), "schemes", self.schemes, f"a non-empty list of {', '.join(QUANT_SCHEMES)}")
        for scheme in self.schemes:
            one_of("schemes", scheme, QUANT_SCHEMES)
            self.quant(scheme)  # validates group_size and the flags
        require(len(set(self.schemes)) == len(self.schemes), "schemes", self.schemes, "without repeats")
        self.quantized_drafters = self.quantized_drafters or {}
        for scheme in self.quantized_drafters:
            require(scheme in self.schemes and scheme != "none", f"quantized_drafters.{scheme}",
                    self.quantized_drafters[scheme], f"keyed by a reported quantized scheme "
                    f"({', '.join(s for s in self.schemes if s != 'none')}); the full-precision one is drafter=")
        self.self_drafts = self.self_drafts or {}
        for target, copy in self.self_drafts.items():
            require(target == "none" or target in self.schemes, f"self_drafts.{target}", copy,
                    f"keyed by none (full precision) or a reported scheme ({', '.join(self.schemes)})")
            require(copy in self.schemes, f"self_drafts.{target}", copy,
                    f"a reported scheme ({', '.join(self.schemes)}): the copy is one of the report's targets")
            check_lower_precision(copy, target)
        at_least(1, self_draft_tokens=self.self_draft_tokens)
        require(self.k is None or self.k >= 1, "k",
                self.k, ">= 1, or null for each drafter's own")
        at_least(1, repeats=self.repeats)
        at_least(2, max_new_tokens=self.max_new_tokens)  # decode speed is timed after the first token

    def quant(self, scheme: str) -> QuantConfig:
        return QuantConfig(scheme, self.group_size, self.quantize_embeddings, self.quantize_lm_head, self.cpu_matmul)

    def both_drafter(self, scheme: str) -> str:
        """Who drafts for the quantized target in "both": the drafter trained against it, if given."""
        return scheme if scheme in self.quantized_drafters else FULL

    def self_ways(self) -> list[tuple[str, str]]:
        """(target, self-drafter key) of every self-drafting pair."""
        return [(FULL if target == "none" else target, SELF + copy) for target, copy in self.self_drafts.items()]


# --- loading ------------------------------------------------------------------------------------


def load(cfg: QuantReportConfig) -> tuple[dict[str, FrozenTarget], dict[str, torch.nn.Module]]:
    """(targets, drafters), both keyed FULL or by scheme: the full-precision target and one per scheme;
    the drafter trained against the full-precision target and those trained against quantized ones."""
    from_gguf = cfg.target.endswith(".gguf")
    drafters = {FULL: load_drafter("drafter", cfg.drafter, QuantConfig(), from_gguf)}
    drafters |= {s: load_drafter(f"quantized_drafters.{s}", path, cfg.quant(s), from_gguf)
                 for s, path in cfg.quantized_drafters.items()}
    target_cfg = TargetConfig.named(cfg.target, layer_ids=drafters[FULL].layer_ids)
    targets = {FULL: FrozenTarget.load(target_cfg)} | {s: FrozenTarget.load(target_cfg, cfg.quant(s))
                                                       for s in cfg.schemes}
    for drafter in drafters.values():
        export.share_target_embedding(drafter, targets[FULL])
    drafters |= {SELF + copy: SelfDrafter(targets[copy], copy, cfg.self_draft_tokens)
                 for copy in cfg.self_drafts.values()}
    return targets, drafters


def load_drafter(key: str, path: str, served: QuantConfig, from_gguf: bool) -> torch.nn.Module:
    """An export, refused if its training record says it was trained against other weights. `from_gguf`:
    the full-precision target is a GGUF file's weights, so quant=gguf and none hold the same weights."""
    if not Path(path).is_dir():
        raise UserError(f"{key}={path!r}: no such export folder")
    drafter, _ = export.load(Path(path))
    trained = (export.training_record(Path(path)) or {}).get("quant")
    as_weights = (lambda q: QuantConfig() if q.scheme == "gguf" else q) if from_gguf else (lambda q: q)
    if trained is not None and not same_quantization(as_weights(QuantConfig(**trained)), as_weights(served)):
        raise UserError(f"{key}={path!r} was trained against a target quantized as {describe(QuantConfig(**trained))},"
                        f" but is served here with {describe(served)}")
    return drafter.eval()


def same_quantization(a: QuantConfig, b: QuantConfig) -> bool:
    """The same quantized weights: the group size matters for int4 only, the flags for every scheme but none."""
    def effective(q):
        return (q.scheme, q.group_size if q.scheme in ("int4", "gptq_int4") else None,
                *((q.quantize_embeddings, q.quantize_lm_head) if q.scheme != "none" else ()))
    return effective(a) == effective(b)


def describe(quant: QuantConfig) -> str:
    if quant.scheme == "none":
        return "no quantization"
    if quant.scheme == "gguf":
        return "gguf: the file's own blocks (Q4_1 layers, Q8_0 embeddings and lm_head)"
    parts = [quant.scheme + (f", groups of {quant.group_size}" if quant.scheme in ("int4", "gptq_int4") else "")]
    parts.append("embeddings " + ("quantized" if quant.quantize_embeddings else "kept"))
    parts.append("lm_head " + ("quantized" if quant.quantize_lm_head else "kept"))
    return "; ".join(parts)


def served_with(target: FrozenTarget, drafter) -> FrozenTarget:
    """The target as `drafter` reads it: the same model, the drafter's feature layers."""
    if drafter is None or list(drafter.layer_ids) == target.layer_ids:
        return target
    return FrozenTarget(target.model, target.tokenizer, target.name_or_path, drafter.layer_ids,
                        fingerprint=target.fingerprint())


# --- measuring ----------------------------------------------------------------------------------


def ways_of_serving(cfg: QuantReportConfig) -> list[tuple[str, str | None]]:
    """(target, drafter or None) of every way the tables need, each once, baseline first."""
    ways = [(FULL, None), (FULL, FULL)]
    for s in cfg.schemes:
        ways += [(s, None), (s, cfg.both_drafter(s)), (s, FULL)]
    return list(dict.fromkeys(ways + cfg.self_ways()))


def way_name(way: tuple[str, str | None]) -> str:
    return f"target={way[0]} drafter={way[1] or '-'}"


def measure(targets: dict, drafters: dict, prompts: list[Prompt], cfg: QuantReportConfig) -> dict:
    """Decode every prompt every way (interleaved, repeated); the four-way and cross tables as a dict."""
    ids = [p.ids for p in prompts]
    ways = ways_of_serving(cfg)
    for target, drafter in ways:
        if drafter is not None:
            check_pair(targets[target], drafters[drafter])
    ks = {key: serving_k(drafter, cfg.k) for key, drafter in drafters.items()}
    decoded = decode_ways({way: (served_with(targets[way[0]], drafters.get(way[1])), drafters.get(way[1]),
                                 ks.get(way[1], 0)) for way in ways},
                          ids, cfg.max_new_tokens, cfg.repeats, cfg.drafting)
    reference = decoded[(FULL, None)].outputs
    kl = {key: mean_kl(targets[FULL], target, ids, reference) for key, target in targets.items()}
    base = statistics.median(decoded[(FULL, None)].tokens_per_s)
    rows = {}
    for way in ways:
        target, drafter = way
        run, alone = decoded[way], decoded[(target, None)]
        speed = statistics.median(run.tokens_per_s)
        agreement, equal_prefix = greedy_agreement(run.outputs, reference)
        rows[way] = {
            "target": target, "drafter": drafter, "weight_bytes": weight_bytes(targets[target].model),
            "decode_tokens_per_s": speed, "tokens_per_s_repeats": run.tokens_per_s, "speedup_vs_baseline": speed / base,
            "acceptance_length": run.stats.acceptance_length if drafter else None,
            "greedy_agreement": agreement, "mean_equal_prefix": equal_prefix, "mean_kl_fp_to_served": kl[target],
            # greedy speculation reproduces the same target's greedy output (w8a8: not always, speculators/quant/__init__.py)
            "same_output_as_target_alone": statistics.mean(a == b for a, b in zip(run.outputs, alone.outputs))
            if drafter else None,
        }
    four_way, cross = {}, {}
    for s in cfg.schemes:
        four_way[s] = {"quant": asdict(cfg.quant(s)), "quant_dequant_rel_error": quant_error(
                           targets[FULL].model, targets[s].model), "linear_ops": linear_ops(targets[s].model),
                       "both_drafter": cfg.both_drafter(s),
                       "rows": {"baseline": rows[(FULL, None)], "quantization_only": rows[(s, None)],
                                "speculation_only": rows[(FULL, FULL)], "both": rows[(s, cfg.both_drafter(s))]}}
        cross[s] = {"fp_drafter_on_fp_target": rows[(FULL, FULL)], "fp_drafter_on_quantized_target": rows[(s, FULL)],
                    "quantized_drafter_on_quantized_target": rows.get((s, s))}
    self_speculation = [{"target": target, "copy": key.removeprefix(SELF), "alone": rows[(target, None)],
                         "drafter": rows[(target, FULL)], "self": rows[(target, key)]} for target, key in cfg.self_ways()]
    return {"four_way": four_way, "cross": cross, "self_speculation": self_speculation,
            "prompts": [p.text for p in prompts],
            "prompt_turns": [p.turn for p in prompts],
            "outputs": {way_name(way): decoded[way].outputs for way in ways},
            "drafters": {key: {"path": drafter_path(cfg, key), "trained_against": trained_against(cfg, key),
                               "k": ks[key]} for key in drafters},
            "config": asdict(cfg), "git_revision": report.git_revision(), "machine": report.machine()}


def drafter_path(cfg: QuantReportConfig, key: str) -> str | None:
    return cfg.drafter if key == FULL else cfg.quantized_drafters.get(key)


def trained_against(cfg: QuantReportConfig, key: str) -> str:
    """What a drafter was trained against, as its training record says; a self-drafting copy is not trained."""
    if key.startswith(SELF):
        return "not trained: the target quantized with " + key.removeprefix(SELF)
    trained = (export.training_record(Path(drafter_path(cfg, key))) or {}).get("quant")
    scheme = trained["scheme"] if trained else "none" if key == FULL else key
    return target_label(FULL if scheme == "none" else scheme)


def greedy_agreement(outputs: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(sum of equal-prefix lengths / sum of reference lengths, mean equal-prefix length)."""
    prefixes = [prefix_match(out, ref) for out, ref in zip(outputs, reference)]
    return sum(prefixes) / sum(len(ref) for ref in reference), statistics.mean(prefixes)


@torch.no_grad()
def mean_kl(full: FrozenTarget, served: FrozenTarget, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """Mean over continuation positions of KL(p_fp || p_served), both teacher-forced on prompt + continuation."""
    total, count = 0.0, 0
    for ids, continuation in zip(prompts, continuations):
        tokens = torch.tensor([ids + continuation[:-1]])
        predicting = slice(len(ids) - 1, None)  # the positions whose next token is a continuation token
        log_p = F.log_softmax(full.model(input_ids=tokens, use_cache=False).logits[0, predicting].float(), -1)
        log_q = F.log_softmax(served.model(input_ids=tokens, use_cache=False).logits[0, predicting].float(), -1)
        total += float((log_p.exp() * (log_p - log_q)).sum())
        count += len(continuation)
    return total / count


# --- writing ------------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    """The four-way table per scheme and the cross table, as Markdown."""
    cfg = result["config"]
    ks = {key: d["k"] for key, d in result["drafters"].items()}
    k = f"{next(iter(ks.values()))}-token" if len(set(ks.values())) == 1 else \
        "K-token (" + ", ".join(f"{drafter_name(key)} {n}" for key, n in ks.items()) + ")"
    lines = [f"{len(result['prompts'])} prompts, {cfg['max_new_tokens']} new tokens each, greedy, "
             f"{k} {cfg['drafting']['mode']} drafts; tokens/s: decode after the "
             f"first token, median of {cfg['repeats']} interleaved repeats; torch {result['machine']['torch']}, "
             f"{result['machine']['torch_threads']} thread(s)."]
    for scheme, entry in result["four_way"].items():
        error = entry["quant_dequant_rel_error"]
        lines += ["", f"**{scheme}** ({describe(QuantConfig(**entry['quant']))}; quantize-dequantize error "
                      f"{'-' if error is None else f'{error:.4f}'})", "",
                  "| | target | drafter | target weights (MiB) | tokens/s | speed-up | tau | greedy agreement "
                  "| mean equal prefix | mean KL(p_fp ‖ p) | same output as the target alone |",
                  "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
        for step, row in entry["rows"].items():
            lines.append(f"| {STEPS[step]} | {target_label(row['target'])} | {drafter_label(row['drafter'], result['drafters'])} "
                         f"| {row['weight_bytes'] / 2**20:.2f} | {row['decode_tokens_per_s']:.1f} "
                         f"| {row['speedup_vs_baseline']:.2f}x | {number(row['acceptance_length'], 2)} "
                         f"| {row['greedy_agreement']:.3f} | {row['mean_equal_prefix']:.1f} "
                         f"| {row['mean_kl_fp_to_served']:.4g} | {number(row['same_output_as_target_alone'], 2)} |")
    if result["self_speculation"]:
        lines += ["", "Quantized self-speculation: the target's own lower-precision copy drafts for it.", "",
                  "| target | drafter | tokens/s | speed-up over the target alone | over the baseline | tau "
                  "| same output as the target alone |", "|---|---|--:|--:|--:|--:|--:|"]
        for entry in result["self_speculation"]:
            alone = entry["alone"]["decode_tokens_per_s"]
            for row in (entry["alone"], entry["drafter"], entry["self"]):
                lines.append(f"| {target_label(row['target'])} | {drafter_label(row['drafter'], result['drafters'])} "
                             f"| {row['decode_tokens_per_s']:.1f} | {row['decode_tokens_per_s'] / alone:.2f}x "
                             f"| {row['speedup_vs_baseline']:.2f}x | {number(row['acceptance_length'], 2)} "
                             f"| {number(row['same_output_as_target_alone'], 2)} |")
    lines += ["", "Cross table: tau of each drafter served with the quantized target.", "",
              "| scheme | fp drafter, fp target | fp drafter, quantized target | quantized drafter, quantized target "
              "| quantized drafter / fp reference |", "|---|--:|--:|--:|--:|"]
    for scheme, entry in result["cross"].items():
        reference = entry["fp_drafter_on_fp_target"]["acceptance_length"]
        own = entry["quantized_drafter_on_quantized_target"]
        own_tau = own and own["acceptance_length"]
        lines.append(f"| {scheme} | {reference:.2f} | {entry['fp_drafter_on_quantized_target']['acceptance_length']:.2f} "
                     f"| {number(own_tau, 2)} | {number(own_tau and own_tau / reference, 3)} |")
    return "\n".join(lines) + "\n"


def target_label(key: str) -> str:
    return "full precision" if key == FULL else key


def drafter_name(key: str) -> str:
    return f"{key.removeprefix(SELF)} copy" if key.startswith(SELF) else f"{target_label(key)} drafter"


def drafter_label(key: str | None, drafters: dict) -> str:
    """`drafters`: the result's, which say what each was trained against."""
    if key is None:
        return "-"
    return f"its {key.removeprefix(SELF)} copy" if key.startswith(SELF) else \
        f"trained on {drafters[key]['trained_against']}"


def number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def all_rows(result: dict) -> list[dict]:
    """Every way of serving once, in the tables' order."""
    rows = [row for entry in result["four_way"].values() for row in entry["rows"].values()]
    rows += [entry[key] for entry in result["self_speculation"] for key in ("alone", "drafter", "self")]
    return list({(row["target"], row["drafter"]): row for row in rows}.values())


def plot(result: dict, path: Path) -> None:
    """Decode tokens/s of every way of serving, tau beside each drafted bar."""
    rows = all_rows(result)
    labels = [f"{target_label(r['target'])} + {drafter_label(r['drafter'], result['drafters'])}" if r["drafter"] else
              target_label(r["target"]) for r in rows]
    speeds = [r["decode_tokens_per_s"] for r in rows]
    with plots.figure(path, (6.5, 0.45 * len(rows) + 1.2)) as ax:
        ax.barh(labels, speeds, color=["tab:blue" if r["drafter"] else "tab:gray" for r in rows])
        for y, r in enumerate(rows):
            if r["drafter"]:
                ax.text(r["decode_tokens_per_s"], y, f" tau {r['acceptance_length']:.2f}", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set(xlabel="decode tokens/s (median of interleaved repeats)", xlim=(0, max(speeds) * 1.3))


def write(result: dict, out_dir: Path) -> Path:
    """quant_report.json, quant_report.md and quant_report.png in out_dir; the tables on the console."""
    return write_result(out_dir, result, markdown(result), "quant_report.json", "quant_report.md",
                        lambda path: plot(result, path))


@hydra.main(config_path=str(PROJECT_ROOT / "conf" / "benchmarks"), config_name="quant_report", version_base="1.3")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    cfg = to_dataclass(QuantReportConfig, cfg)
    targets, drafters = load(cfg)
    result = measure(targets, drafters, evalsets.prompts(cfg.eval, targets[FULL], cfg.max_new_tokens), cfg)
    path = write(result, Path(cfg.out or HydraConfig.get().runtime.output_dir))
    print(f"quantization report: {path}")


if __name__ == "__main__":
    run_cli(main)
