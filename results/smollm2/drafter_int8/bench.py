"""The shipped drafter with every linear layer stored as int8 (a scale per row, speculators.quant's
WeightOnlyInt8Linear through our CPU kernel) against the drafter as shipped (fp32 compute), on the packed target.

    python results/smollm2/drafter_int8/bench.py results/smollm2/drafter_int8/bench.json

Both turns of 8 MT-bench conversations, 128 new tokens, greedy, chains of K=2 and K=5, interleaved with
target-only decoding in benchmarks.rounds (2 rounds); tau from the engine's counters; outputs compared
token by token. 2 threads; run it with nothing beside.
"""

import copy
import json
import sys

import torch
from torch import nn

from benchmarks import rounds
from inference import evalsets, report
from inference.engine import generate
from inference.evalsets import EvalConfig
from speculators.quant import QuantConfig, WeightOnlyInt8Linear


def int8_copy(drafter: nn.Module) -> nn.Module:
    copied = copy.deepcopy(drafter)
    for module in list(copied.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, WeightOnlyInt8Linear(child.weight, child.bias, "kernel"))
    return copied


def main(out: str) -> None:
    torch.set_num_threads(2)
    drafter, target = report.load_pair("models/smollm2-eagle3", quant=QuantConfig(scheme="gguf"))
    drafters = {"fp32": drafter, "int8": int8_copy(drafter)}
    prompts = [p.ids for p in evalsets.prompts(EvalConfig(name="mtbench", num_prompts=8, turns=2), target, 128)]
    counts = {}

    def way(name: str, k: int):
        def decode(ids):
            generation = generate(target, drafters[name.split("_")[0]] if k else None, ids, 128, k=k)
            drafts, accepted = counts.get(name, (0, 0))
            counts[name] = (drafts + generation.stats.num_drafts, accepted + generation.stats.num_accepted_tokens)
            return generation.tokens
        return decode

    ways = {"target_only": way("target_only", 0)} | {f"{name}_k{k}": way(f"{name}_k{k}", k)
                                                     for k in (2, 5) for name in drafters}
    timed = rounds.interleaved(ways, prompts, repeats=2)
    base = timed["target_only"]
    rows = {name: {"tokens_per_second": round(t.median_tokens_per_s(), 2),
                   "speedup": round(t.median_tokens_per_s() / base.median_tokens_per_s(), 3),
                   "tau": round(1 + counts[name][1] / counts[name][0], 3) if counts[name][0] else None,
                   "outputs_match_target_only": t.results == base.results} for name, t in timed.items()}
    linear_bytes = {name: sum(t.numel() * t.element_size() for m in d.modules() if isinstance(m, (nn.Linear, WeightOnlyInt8Linear))
                              for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)] if t is not None)
                    for name, d in drafters.items()}
    result = {"rows": rows, "linear_layer_bytes": linear_bytes, "git_revision": report.git_revision(),
              "machine": report.machine()}
    print(json.dumps(result["rows"], indent=2), linear_bytes)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1])
