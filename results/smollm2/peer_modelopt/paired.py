"""ModelOpt's EAGLE-3 against ours and vLLM's speculators, prompt by prompt, at 40 steps.

    python results/smollm2/peer_modelopt/paired.py

Reads each drafter's served results (greedy tau per prompt, K=3, 64 new tokens, 1 thread): ModelOpt's from
served/ here (benchmarks.peer train=false), ours_cached and peer_matched from ../peer_speculators/fp32/served
(trained on the same rows and steps: results/smollm2/peer_speculators), all on both turns of the first 12 MT-bench conversations and the
first 12 ShareGPT test conversations. A prompt is matched by (set,
turn, rank within them) and its token count checked; greedy tau per prompt depends only on the drafter and the
target. Writes paired.json: every pair's tau difference, mean ± standard error over prompts, and on how many
prompts it is higher / lower, over all prompts and per set.
"""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETTINGS = "k3_m12_s12_t64_th1"
FILES = {"modelopt": HERE / "served" / f"modelopt_40_{SETTINGS}.json",
         "ours_cached": HERE.parent / "peer_speculators" / "fp32" / "served" / f"ours_cached_40_{SETTINGS}.json",
         "peer_matched": HERE.parent / "peer_speculators" / "fp32" / "served" / f"peer_matched_40_{SETTINGS}.json"}


def spread(values: list[float]) -> dict:
    sd = statistics.stdev(values)
    return {"mean": round(statistics.fmean(values), 4), "sd": round(sd, 4), "se": round(sd / len(values) ** 0.5, 4),
            "n": len(values)}


def main() -> None:
    served = {name: json.loads(path.read_text()) for name, path in FILES.items()}
    tau = {}
    for name, s in served.items():
        rank, keyed = {}, {}
        for p, t in zip(s["prompts"], s["drafter"]["tau_per_prompt"]):
            group = (p["set"], p["turn"])
            rank[group] = rank.get(group, -1) + 1
            keyed[group + (rank[group],)] = (p["tokens"], t)
        tau[name] = keyed
    keys = list(tau["modelopt"])
    for name in tau:
        assert all(tau[name][k][0] == tau["modelopt"][k][0] for k in keys), f"{name}: a prompt of other length"
    tau = {name: [tau[name][k][1] for k in keys] for name in tau}
    out = {"prompts": len(keys), "tau_over_these_prompts": {name: spread(tau[name]) for name in tau},
           "pooled_tau_as_served": {name: round(s["drafter"]["tau"], 4) for name, s in served.items()},
           "outputs_match_target_only": {name: s["drafter"]["outputs_match_target_only"] for name, s in served.items()}}
    sets = {"all": list(range(len(keys)))} | {s: [i for i, k in enumerate(keys) if k[0] == s] for s in dict.fromkeys(k[0] for k in keys)}
    for a, b in (("ours_cached", "modelopt"), ("peer_matched", "modelopt"), ("ours_cached", "peer_matched")):
        for set_name, idx in sets.items():
            diff = [tau[a][i] - tau[b][i] for i in idx]
            out[f"{a} - {b}, {set_name}"] = spread(diff) | {"higher": sum(d > 0 for d in diff), "lower": sum(d < 0 for d in diff)}
    (HERE / "paired.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
