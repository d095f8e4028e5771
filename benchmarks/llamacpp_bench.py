"""llama.cpp as the CPU peer: our drafter (EAGLE-3 or DSpark) served by llama.cpp, on the GGUF target it was
trained against.

    python -m benchmarks.llamacpp_bench drafter=<EAGLE-3 or DSpark export of a GGUF target> [eval=mtbench]
        [max_new_tokens=128] [k=K] [repeats=3] [confidence_min=P] [out=DIR]

On the same prompts, greedy, one thread, interleaved prompt by prompt (benchmarks/rounds.py):
- llamacpp_target_only: llama-completion, llama.cpp's plain decoding (the speed-up baseline);
- llamacpp_target_only_ubatch1: the same with the prompt computed one token per pass (-ub 1). llama.cpp's
  logits depend on how many tokens a pass holds, so where this output differs from the baseline's, no
  speculation (whose verification passes hold K + 1 tokens) can be expected to reproduce it exactly;
- llamacpp_ngram: llama.cpp's n-gram speculation (llama-speculative-simple --spec-type ngram-simple);
- llamacpp_<family>_chain: the drafter exported as GGUF (speculators/formats/gguf.py), --spec-type
  draft-<family> (the family its config.json names), K drafts a step. DSpark: with --spec-draft-p-min 0,
  its confidence threshold off, so every step drafts K as ours does;
- llamacpp_dspark_confidence (DSpark, confidence_min set): llama.cpp's variable length, each step's draft
  cut at the first slot whose confidence head (a sigmoid) is below confidence_min; llama.cpp's alone;
- ours_target_only, ours_<family>_chain: our engine (inference/engine.py) on the same target file.
llama.cpp's figures are its decode speed (after the prompt pass), ours wall time with the prompt.
Outputs are compared with llama.cpp's plain continuation and with their own engine's over their common length
(speculative-simple may run past n_predict by part of a draft). Parity: llama.cpp's accepted share of draft tokens and tau
(1 + accepted / drafts) beside our engine's for the same drafter, target, prompts and K.
DSpark's block: llama.cpp runs [anchor, MASK x (K-1)], ours the trained [anchor, MASK x (B-1)], and the
block's attention is not causal, so below K = B the two engines' drafts may differ by design.
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from benchmarks import rounds
from common.config import PROJECT_ROOT, UserError, at_least, exit_on_user_error, require, run_cli, to_dataclass
from engines import llamacpp
from inference import evalsets, report
from inference.drafting import serving_k
from inference.engine import generate
from inference.evalsets import EvalConfig, Prompt
from speculators import export, gguf_file
from speculators.quant import QuantConfig


@dataclass
class LlamacppBenchConfig:
    drafter: str = "???"  # an EAGLE-3 or DSpark export whose target is a GGUF file
    eval: EvalConfig = field(default_factory=lambda: EvalConfig("mtbench", num_prompts=4))
    max_new_tokens: int = 128
    k: int | None = None  # K of both engines' chains; None: the drafter's own
    ngram_draft_max: int = 3  # llama.cpp's n-gram drafts
    repeats: int = 3
    threads: int = 1
    confidence_min: float | None = 0.5  # DSpark: also llama.cpp's confidence-cut drafts at this threshold; None: not
    out: str | None = None  # None: the Hydra run directory

    def __post_init__(self):
        require(self.k is None or self.k >= 1, "k",
                self.k, ">= 1, or null for the drafter's own")
        require(self.confidence_min is None or 0 < self.confidence_min < 1, "confidence_min", self.confidence_min,
                "in (0, 1), or null for no confidence-cut arm")
        at_least(1, max_new_tokens=self.max_new_tokens, ngram_draft_max=self.ngram_draft_max, repeats=self.repeats,
                 threads=self.threads)


@dataclass
class Run:
    """One generation, whichever engine ran it."""

    tokens: int
    seconds: float
    continuation: str  # the generated text
    drafted: int = 0
    accepted: int = 0
    drafts: int | None = None  # verification steps with a draft; None where the engine did not count them


def after_prompt(text: str, prompt: str) -> str:
    """The generated part of a tool's printed text (the prompt, then the continuation)."""
    start = text.find(prompt)
    if start < 0:
        raise UserError("llama.cpp did not print the prompt it was given; its output format changed?")
    return text[start + len(prompt):]


def ways(target, drafter, draft_gguf: Path, k: int, cfg: LlamacppBenchConfig) -> dict:
    """name -> function(Prompt) -> Run."""
    source, n, threads, family = gguf_file.locate(target.name_or_path), cfg.max_new_tokens, cfg.threads, drafter.cfg.family

    def text(p: Prompt) -> str:  # the templated prompt, special tokens as text (llama.cpp parses them)
        return target.tokenizer.decode(p.ids)

    def plain(ubatch: int | None = None):
        def way(p: Prompt) -> Run:
            r = llamacpp.completion(source, text(p), n, threads=threads, ubatch=ubatch)
            return Run(r.n_predict, r.n_predict / r.decode_tokens_per_s, after_prompt(r.text, text(p)))
        return way

    def speculative(draft: Path | None, spec_type: str, draft_max: int, p_min: float | None = None):
        def way(p: Prompt) -> Run:
            r = llamacpp.speculative_simple(source, draft, text(p), n, draft_max=draft_max, spec_type=spec_type,
                                            threads=threads, p_min=p_min)
            return Run(r.n_predict, r.n_predict / r.decode_tokens_per_s, after_prompt(r.text, text(p)),
                       r.n_drafted, r.n_accept, r.n_drafts)
        return way

    def ours(k_: int):
        def way(p: Prompt) -> Run:
            result = generate(target, drafter if k_ else None, p.ids, n, k_)
            s = result.stats
            return Run(len(result.tokens), s.ttft_s + s.decode_s, target.tokenizer.decode(result.tokens),
                       s.num_draft_tokens, s.num_accepted_tokens, s.num_drafts)
        return way

    arms = {name: speculative(draft_gguf, f"draft-{family}", k, p_min)
            for name, p_min in drafter_arms(family, cfg.confidence_min).items()}
    return {"llamacpp_target_only": plain(),
            "llamacpp_target_only_ubatch1": plain(ubatch=1),  # the prompt one token per pass: same output?
            "llamacpp_ngram": speculative(None, "ngram-simple", cfg.ngram_draft_max),
            **arms, "ours_target_only": ours(0), f"ours_{family}_chain": ours(k)}


def drafter_arms(family: str, confidence_min: float | None) -> dict[str, float | None]:
    """llama.cpp's arms serving the drafter: name -> --spec-draft-p-min (None: not passed)."""
    if family != "dspark":
        return {f"llamacpp_{family}_chain": None}
    arms = {"llamacpp_dspark_chain": 0.0}  # the confidence cut off: K drafts every step, as ours
    if confidence_min is not None:
        arms["llamacpp_dspark_confidence"] = confidence_min
    return arms


def same_output(runs: list[Run], baseline: list[Run]) -> bool:
    """Every continuation agrees with the baseline's over their common length."""
    def agree(a: str, b: str) -> bool:
        a, b = a.rstrip(), b.rstrip()
        return a.startswith(b) or b.startswith(a)
    return all(agree(r.continuation, b.continuation) for r, b in zip(runs, baseline))


def run(target, drafter, prompts: list[Prompt], cfg: LlamacppBenchConfig, draft_gguf: Path) -> dict:
    k, family = serving_k(drafter, cfg.k), drafter.cfg.family
    timed = rounds.interleaved(ways(target, drafter, draft_gguf, k, cfg), prompts, cfg.repeats,
                               count=lambda r, _: (r.tokens, r.seconds))
    rows = {}
    for name, t in timed.items():
        base = timed[f"{name.split('_')[0]}_target_only"]
        rows[name] = {"tokens_per_second": t.median_tokens_per_s(),
                      "speedup": t.median_tokens_per_s() / base.median_tokens_per_s(),
                      "speedup_over_llamacpp": t.median_tokens_per_s() / timed["llamacpp_target_only"].median_tokens_per_s(),
                      "outputs_match_llamacpp_target_only": same_output(t.results, timed["llamacpp_target_only"].results),
                      "outputs_match_own_target_only": same_output(t.results, base.results),  # same engine's plain
                      **draft_counts(t.results), "seconds": t.seconds}
    ours, theirs = rows[f"ours_{family}_chain"], rows[f"llamacpp_{family}_chain"]
    parity = {"ours": ours["acceptance_rate"], "llamacpp": theirs["acceptance_rate"],
              "relative_difference": relative(theirs["acceptance_rate"], ours["acceptance_rate"]),
              "tau_ours": ours["tau"], "tau_llamacpp": theirs["tau"]}
    return {"k": k, "family": family, "methods": rows, "acceptance_parity": parity}


def draft_counts(runs: list[Run]) -> dict:
    """Draft tokens, accepted ones, drafts, their accepted share and tau = 1 + accepted / drafts."""
    drafted, accepted = sum(r.drafted for r in runs), sum(r.accepted for r in runs)
    drafts = None if any(r.drafts is None for r in runs) else sum(r.drafts for r in runs)
    return {"num_draft_tokens": drafted, "num_accepted_tokens": accepted, "num_drafts": drafts,
            "acceptance_rate": accepted / drafted if drafted else None,
            "tau": 1 + accepted / drafts if drafts else None}


def relative(theirs: float | None, ours: float | None) -> float | None:
    return abs(theirs - ours) / ours if theirs is not None and ours else None


def check_gguf_target(target) -> None:
    if not target.name_or_path.endswith(".gguf"):
        raise UserError(f"llama.cpp serves GGUF targets; this drafter's target is {target.name_or_path} (train "
                        f"against a GGUF target, e.g. conf=eagle3_smollm2)")


def table(result: dict) -> str:
    lines = [f"{'method':<28} {'tokens/s':>9} {'speed-up':>9} {'drafted':>8} {'accepted':>9} {'tau':>6} "
             f"{'= llama.cpp plain':>17} {'= own plain':>11}"]
    for name, row in result["methods"].items():
        rate = percent(row["acceptance_rate"])
        tau = f"{row['tau']:.2f}" if row.get("tau") is not None else "-"  # records before tau was kept: "-"
        lines.append(f"{name:<28} {row['tokens_per_second']:>9.1f} {row['speedup']:>8.2f}x "
                     f"{row['num_draft_tokens']:>8} {rate:>9} {tau:>6} {str(row['outputs_match_llamacpp_target_only']):>17} "
                     f"{str(row.get('outputs_match_own_target_only', '-')):>11}")
    p = result["acceptance_parity"]
    lines.append(f"accepted share of draft tokens, {result.get('family', 'eagle3')} K={result['k']}: llama.cpp "
                 f"{percent(p['llamacpp'])}, ours {percent(p['ours'])}")
    return "\n".join(lines)


def percent(share: float | None) -> str:
    return f"{share:.1%}" if share is not None else "-"


def measure(drafter_path: str, drafter, target, cfg: LlamacppBenchConfig, out: Path) -> dict:
    """The comparison, with the GGUF export it served written under `out`."""
    check_gguf_target(target)
    draft = export.save(drafter, out / "draft.gguf", export.Verifier.of(target), fmt="gguf", overwrite=True)
    prompts = evalsets.prompts(cfg.eval, target, cfg.max_new_tokens)
    return run(target, drafter, prompts, cfg, draft) | {
        "drafter": drafter_path, "target": target.name_or_path, "config": asdict(cfg),
        "git_revision": report.git_revision(), "machine": report.machine()}


@hydra.main(config_path=str(PROJECT_ROOT / "conf" / "benchmarks"), config_name="llamacpp_bench", version_base="1.3")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    cfg = to_dataclass(LlamacppBenchConfig, cfg)
    record = export.training_record(Path(cfg.drafter)) or {}
    # the drafter as trained: llama.cpp serves the GGUF written from it
    drafter, target = report.load_pair(cfg.drafter, quant=QuantConfig(**record.get("quant", {})), drafter_quant="none")
    out = Path(cfg.out or HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = measure(cfg.drafter, drafter, target, cfg, out)
    (out / "llamacpp.json").write_text(json.dumps(result, indent=2))
    print(table(result))
    print(f"llama.cpp comparison: {out / 'llamacpp.json'}")


if __name__ == "__main__":
    run_cli(main)
