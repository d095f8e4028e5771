"""Ours minus the peer, paired prompt by prompt, over every prompt served in the folders below (issue #56).

    python results/smollm2/peer_speculators/pooled.py

Each folder's served/ holds one file per drafter and prompt set (benchmarks.peer). A prompt is known by its set,
its turn and its place among that set's prompts of that turn; where two folders served the same prompt
(the first conversations of a set), its tau must agree (greedy decoding is deterministic) and is counted once.
Writes pooled.json and prints one markdown table: per set and over all, mean ± standard error, and the
prompts where ours is higher / lower.
"""

import json
from collections import defaultdict
from pathlib import Path

from benchmarks.peer import spread

HERE = Path(__file__).resolve().parent
FOLDERS = ("fp32", "fp32_sharegpt48", "fp32_sharegpt48_40", "fp32_sharegpt96", "fp32_mtbench40", "fp32_mtbench80")
PAIRS = {40: ("ours_cached_40", "peer_matched_40"), 120: ("ours_cached_120", "peer_matched_120"),
         240: ("ours_cached_240", "peer_matched_240")}


def taus(drafter: str) -> dict[tuple, float]:
    """(set, turn, place) -> tau over every folder's served file of `drafter`; a prompt served twice must agree."""
    out = {}
    for folder in FOLDERS:
        for path in sorted((HERE / folder / "served").glob(f"{drafter}_k3_*.json")):
            served = json.loads(path.read_text())
            place = defaultdict(int)
            for prompt, tau in zip(served["prompts"], served["drafter"]["tau_per_prompt"]):
                key = (prompt["set"], prompt["turn"], place[prompt["set"], prompt["turn"]])
                place[prompt["set"], prompt["turn"]] += 1
                if key in out and abs(out[key] - tau) > 1e-12:
                    raise SystemExit(f"{path}: prompt {key} has tau {tau}, another folder {out[key]}")
                out[key] = tau
    return out


def paired(diffs: list[float]) -> dict:
    s = spread(diffs)
    return {"n": s["n"], "mean": s["mean"], "se": s["se"], "z": s["mean"] / s["se"], "higher": sum(d > 0 for d in diffs),
            "lower": sum(d < 0 for d in diffs)}


def main() -> None:
    result = {}
    for steps, (ours, peer) in PAIRS.items():
        a, b = taus(ours), taus(peer)
        common = sorted(a.keys() & b.keys())
        by_set = {name: paired([a[k] - b[k] for k in common if k[0] == name]) for name in sorted({k[0] for k in common})}
        result[steps] = by_set | {"all": paired([a[k] - b[k] for k in common])}
    (HERE / "pooled.json").write_text(json.dumps(result, indent=1) + "\n")
    print("| steps | " + " | ".join(result[40]) + " |")
    print("|---|" + "---|" * len(result[40]))
    for steps, cols in result.items():
        cells = [f"{c['mean']:+.3f} ± {c['se']:.3f} ({c['z']:.1f} s.e.; {c['n']} prompts, {c['higher']} / {c['lower']})"
                 for c in cols.values()]
        print(f"| {steps} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
