"""Decode-speed benchmark: our speculative decoding against target-only decoding and peers.

    python -m benchmarks.bench drafter=<export dir> [quant=gguf|int4|...] [assistant=<small HF model dir>|null] [eval=stdlib|mtbench|...]
        [repeats=3] [out=DIR]

Methods, all greedy, on the same prompts (eval=, inference/evalsets.py), interleaved prompt by prompt within each
repeat so every method sees the same machine load; figures are medians over repeats:
- target_only: our decode loop with K=0 (the speed-up baseline);
- speculative_chain / speculative_tree: our speculative decoding with the given drafter,
  K-token chains and (for drafters that have one) tree drafts; K = k, or
  the drafter's own (the depth it was trained for) when null;
- hf_greedy: transformers' generate (for reference: how fast the stock loop is);
- speculative_chain_min_prob<p>: chains of K that stop before a draft the drafter's top probability is below p
  (drafting.chain_min_prob, llama.cpp's --draft-p-min), for each p in chain_min_probs;
- speculative_chain_k<K>_lookup: chains of K behind n-gram lookup (inference.lookup.LookupProposer: a
  lookup chain when the context's last n tokens occurred before, the drafter's chain otherwise), for each
  K in lookup_chain_lengths;
- hf_prompt_lookup: transformers' prompt-lookup decoding (n-gram drafts from the context, the same
  longest n-gram and lookup chain length);
- hf_assisted: transformers' assisted generation with a small draft model (default: the shipped
  models/pycode-assistant, which shares the default target's tokenizer; assistant=null skips it).
"""

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from benchmarks import rounds
from common.config import PROJECT_ROOT, at_least, exit_on_user_error, require, run_cli, to_dataclass
from inference import drafting, evalsets
from inference.drafting import serving_k
from inference.evalsets import EvalConfig
from speculators.quant import QuantConfig


@dataclass
class BenchConfig:
    drafter: str = "???"
    target: str | None = None
    quant: QuantConfig = field(default_factory=QuantConfig)  # the target as served: quant=gguf, its file's own 4-bit blocks
    assistant: str | None = None  # a small causal LM with the target's tokenizer, for assisted generation; null: skip
    eval: EvalConfig = field(default_factory=EvalConfig)  # the prompts: eval=stdlib | mtbench | sharegpt | file
    max_new_tokens: int = 64
    k: int | None = None  # K; None: the drafter's own
    modes: list[str] | None = None  # drafting modes to run (chain, tree); None: every mode the drafter has
    chain_lengths: list[int] = field(default_factory=list)  # more chain lengths K to time beside the drafter's own
    chain_min_probs: list[float] = field(default_factory=list)  # chains of K ending where the drafter is unsure
    tree_top_k: int = 4  # as in inference.drafting.DraftingConfig
    tree_total_tokens: int = 16
    lookup_chain_lengths: list[int] = field(default_factory=list)  # K of chains behind n-gram lookup, e.g. [1]
    prompt_lookup_max: int = 3  # the longest n-gram matched (ours, and transformers' max_matching_ngram_size)
    prompt_lookup_min: int = 2  # ours: the shortest (transformers' goes down to 1)
    prompt_lookup_tokens: int = 5  # tokens in a lookup chain (ours, and transformers' prompt_lookup_num_tokens)
    repeats: int = 3
    out: str | None = None

    def __post_init__(self):
        require(self.k is None or self.k >= 1, "k",
                self.k, ">= 1, or null for the drafter's own")
        at_least(1, max_new_tokens=self.max_new_tokens, prompt_lookup_tokens=self.prompt_lookup_tokens,
                 prompt_lookup_max=self.prompt_lookup_max, repeats=self.repeats)
        self.lookup()  # validates the lookup settings
        for key in ("chain_lengths", "lookup_chain_lengths"):
            require(all(k >= 1 for k in getattr(self, key)), key, getattr(self, key), "chain lengths >= 1")
        for p in self.chain_min_probs:
            drafting.DraftingConfig(chain_min_prob=p)  # validates each

    def lookup(self) -> "drafting.DraftingConfig":
        """Chains behind n-gram lookup, as these settings draft them."""
        return drafting.DraftingConfig(prompt_lookup_max=self.prompt_lookup_max,
                                       prompt_lookup_min=self.prompt_lookup_min,
                                       prompt_lookup_tokens=self.prompt_lookup_tokens)


def methods(target, drafter, assistant, cfg: BenchConfig) -> dict:
    """name -> function(prompt ids) -> generated ids (cfg.k set: run() resolves it)."""
    from inference.engine import generate

    hf = dict(do_sample=False, max_new_tokens=cfg.max_new_tokens,
              pad_token_id=target.tokenizer.pad_token_id)

    def speculative(mode: str, k: int, how: drafting.DraftingConfig | None = None):
        how = how or drafting.DraftingConfig(mode, cfg.tree_top_k, cfg.tree_total_tokens)
        return lambda ids: generate(target, drafter, ids, cfg.max_new_tokens, k, drafting=how).tokens

    def hf_generate(ids, **extra):
        out = target.model.generate(torch.tensor([ids]), **hf, **extra)
        return out[0, len(ids):].tolist()

    runs = {
        "target_only": lambda ids: generate(target, None, ids, cfg.max_new_tokens, 0).tokens,
        **{f"speculative_{mode}": speculative(mode, cfg.k)
           for mode in cfg.modes or drafting.modes(drafter)},
        **{f"speculative_chain_k{k}": speculative("chain", k) for k in cfg.chain_lengths},
        **{f"speculative_chain_min_prob{p}": speculative("chain", cfg.k,
                                                          drafting.DraftingConfig(chain_min_prob=p))
           for p in cfg.chain_min_probs},
        **{f"speculative_chain_k{k}_lookup": speculative("chain", k, cfg.lookup()) for k in cfg.lookup_chain_lengths},
        "hf_greedy": hf_generate,
        "hf_prompt_lookup": lambda ids: hf_generate(ids, prompt_lookup_num_tokens=cfg.prompt_lookup_tokens,
                                                    max_matching_ngram_size=cfg.prompt_lookup_max),
    }
    if assistant is not None:
        runs["hf_assisted"] = lambda ids: hf_generate(ids, assistant_model=assistant)
    return runs


def run(target, drafter, assistant, prompts: list[list[int]], cfg: BenchConfig) -> dict:
    """name -> figures; the speculative methods also say the K they drafted (null in cfg: the drafter's own)."""
    cfg = replace(cfg, k=serving_k(drafter, cfg.k))
    timed = rounds.interleaved(methods(target, drafter, assistant, cfg), prompts, cfg.repeats)
    base = timed["target_only"].median_tokens_per_s()
    return {name: {"tokens_per_second": t.median_tokens_per_s(), "seconds": t.seconds, "tokens": t.tokens,
                   "speedup": t.median_tokens_per_s() / base,
                   # every method here is greedy: each must reproduce target-only greedy output
                   "outputs_match_target_only": t.results == timed["target_only"].results}
            | ({"k": chain_length(name, cfg)} if name.startswith("speculative_") else {})
            for name, t in timed.items()}


def chain_length(method: str, cfg: BenchConfig) -> int:
    """K of a speculative method: speculative_chain_k<K>[_lookup] or the run's own."""
    return int(method.rsplit("_k", 1)[1].removesuffix("_lookup")) if "_k" in method else cfg.k


def load_assistant(path: str | None, target):
    """The peer's small draft model; transformers' assisted generation needs it to share the target's vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None:
        return None
    require((Path(path) / "config.json").is_file(), "assistant", path, "a saved causal LM folder (or null)")
    same_vocabulary = AutoTokenizer.from_pretrained(path).get_vocab() == target.tokenizer.get_vocab()
    require(same_vocabulary, "assistant", path, f"a model with the target's tokenizer ({target.name_or_path}), or null")
    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def table(rows: dict) -> str:
    lines = [f"{'method':<28} {'tokens/s':>9} {'speed-up':>9} {'same output':>12}"]
    for name, row in rows.items():
        lines.append(f"{name:<28} {row['tokens_per_second']:>9.1f} {row['speedup']:>8.2f}x "
                     f"{str(row['outputs_match_target_only']):>12}")
    return "\n".join(lines)


@hydra.main(config_path=str(PROJECT_ROOT / "conf" / "benchmarks"), config_name="bench", version_base="1.3")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    from inference import report

    cfg = to_dataclass(BenchConfig, cfg)
    drafter, target = report.load_pair(cfg.drafter, cfg.target, cfg.quant)
    assistant = load_assistant(cfg.assistant, target)
    prompts = [p.ids for p in evalsets.prompts(cfg.eval, target, cfg.max_new_tokens)]
    rows = run(target, drafter.eval(), assistant, prompts, cfg)
    result = {"methods": rows, "config": asdict(cfg), "git_revision": report.git_revision(),
              "machine": report.machine()}
    out = Path(cfg.out or HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    print(table(rows))
    print(f"benchmark: {out / 'bench.json'}")


if __name__ == "__main__":
    run_cli(main)
