"""Our DSpark beside vLLM's speculators 0.9.0 DSpark: the same target, rows, split and steps, both served by
this project's engine on the same prompts.

    python -m benchmarks.peers.dspark_bench n=384 steps=120 seed=0 threads=1

- ours: `python train.py conf=dspark_smollm2` from scratch with the recipe written out (4 x 512 tokens a step,
  block 8, 32 anchors a row, vanilla Markov head of rank 256, confidence head, 8,192-token draft vocabulary,
  layers [2, 15, 27], AdamW lr 1e-3, 10 warm-up steps then cosine); the target runs every step.
- speculators: benchmarks/peers/speculators_dspark.py (its venv made on demand) on the rows and hidden states
  that speculators_peer.py makes once per N, the same recipe where its flags reach.

Each arm trains into <runs>/<arm>/n<N>_s<steps>_seed<seed> (an export there is reused), at niceness `nice`
under /usr/bin/time -v, as benchmarks/peer.py runs its arms. Both drafters are served greedy at K = the block
size on both turns of `mtbench_conversations` MT-bench conversations and `sharegpt_conversations` ShareGPT
test conversations, with target-only decoding interleaved (benchmarks.peer.serve); tau per prompt gives the
paired difference ours - speculators and its standard error. Writes peer_dspark.json and peer_dspark.md to `out`.
"""

import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks import peer, peers
from benchmarks.peers import records
from benchmarks.tables import paired
from common.config import at_least, run_command
from forge_kernels.provenance import git_revision, machine

ARMS = ("ours", "speculators")


@dataclass
class DSparkPeerConfig:
    """conf/benchmarks/peer_dspark.yaml."""

    n: int = 384  # the first N conversations of data/sharegpt-smollm2 (our data.max_examples)
    steps: int = 120  # optimizer steps of each arm
    seed: int = 0
    threads: int = 1  # OMP/torch threads of both trainings and of serving
    install: bool = True  # make speculators' venv on first use (false: one line on how instead)
    block_size: int = 8  # both arms' block, and the K served
    anchors: int = 32  # blocks a 512-token row (the peer: anchors x batch over its packed step)
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    ours_overrides: list[str] = field(default_factory=list)  # more `train.py` overrides for ours
    peer_env: dict[str, str] = field(default_factory=dict)  # more speculators_dspark.py knobs (EXTRA: more flags)
    runs: str = "runs/peer_dspark"
    out: str = "results/smollm2/peer_speculators_dspark"
    train: bool = True  # false: serve the arms already trained
    serve: bool = True
    max_new_tokens: int = 64
    mtbench_conversations: int = 12  # both turns of each
    sharegpt_conversations: int = 12
    quant: str = "gguf"  # the target as served (both arms trained against the Q4_1 file's weights)
    nice: int = 10
    quiet_lock: str = "/tmp/quiet.lock"
    pids_file: str = "/tmp/background.pids"

    def __post_init__(self):
        at_least(1, n=self.n, steps=self.steps, threads=self.threads, anchors=self.anchors, markov_rank=self.markov_rank)
        at_least(2, block_size=self.block_size)
        at_least(0, mtbench_conversations=self.mtbench_conversations, sharegpt_conversations=self.sharegpt_conversations)


def peer_config(cfg: DSparkPeerConfig) -> peer.PeerBenchConfig:
    """benchmarks.peer's settings for what it does here: running, logging, the peer's data, serving at K = block."""
    return peer.PeerBenchConfig(n=cfg.n, steps=[cfg.steps], arms=[], seed=cfg.seed, threads=cfg.threads,
                                install=cfg.install, runs=cfg.runs, out=cfg.out, k=cfg.block_size,
                                max_new_tokens=cfg.max_new_tokens, mtbench_conversations=cfg.mtbench_conversations,
                                sharegpt_conversations=cfg.sharegpt_conversations, quant=cfg.quant, serve=cfg.serve,
                                nice=cfg.nice, quiet_lock=cfg.quiet_lock, pids_file=cfg.pids_file)


def run_dir(cfg: DSparkPeerConfig, arm: str) -> Path:
    return peer.root_path(cfg.runs) / arm / f"n{cfg.n}_s{cfg.steps}_seed{cfg.seed}"


def ours_command(cfg: DSparkPeerConfig, folder: Path) -> list[str]:
    """Our arm from scratch, conf/conf/dspark_smollm2.yaml's recipe written out (the peer matches these)."""
    recipe = ["conf=dspark_smollm2", "data.hidden_states=online", f"drafter.block_size={cfg.block_size}",
              f"drafter.anchors={cfg.anchors}", f"drafter.markov_rank={cfg.markov_rank}",
              f"drafter.markov_head_type={cfg.markov_head_type}"]
    return peers.train_command(recipe, cfg.n, cfg.steps, cfg.threads, cfg.seed, cfg.ours_overrides, folder)


def peer_command(cfg: DSparkPeerConfig, folder: Path) -> tuple[list[str], dict[str, str]]:
    env = {"SEED": str(cfg.seed), "BLOCK": str(cfg.block_size), "ANCHORS": str(cfg.anchors * 4),  # 4 rows a step
           "MARKOV_RANK": str(cfg.markov_rank), "MARKOV_TYPE": cfg.markov_head_type} | dict(cfg.peer_env)
    return [sys.executable, "-m", "benchmarks.peers.speculators_dspark", str(cfg.n), str(cfg.steps),
            str(folder / "export"), str(folder / "work")], env


def train_arm(cfg: DSparkPeerConfig, arm: str) -> Path:
    folder, pcfg = run_dir(cfg, arm), peer_config(cfg)

    def command() -> tuple[list[str], dict[str, str]]:
        if arm == "ours":
            return ours_command(cfg, folder), {}
        peer.peer_prepare(pcfg)  # rows and hidden states, once per N
        peer.link_peer_data(pcfg, folder)
        return peer_command(cfg, folder)

    return peer.train_once(pcfg, folder, f"{arm} at {cfg.steps} steps", arm == "ours", command)


def record(cfg: DSparkPeerConfig, arm: str, folder: Path) -> dict:
    pcfg = peer_config(cfg)
    rec = records.ours_record(folder, peer.peer_split(pcfg)) if arm == "ours" else records.peer_record(folder)
    if arm != "ours":  # speculators' own model against our reader of its export, on the same random inputs
        found = re.findall(r"== logits against speculators' own model: (\{.*\})", (folder / "train.log").read_text(errors="replace"))
        rec["logits_against_speculators"] = json.loads(found[-1]) if found else None
    command = (folder / "train.cmd").read_text().strip() if (folder / "train.cmd").is_file() else None
    return rec | {"name": arm, "arm": arm, "folder": str(folder), "command": command}


def markdown(rows: list[dict], served: dict | None, difference: dict | None) -> str:
    lines = ["| arm | steps | tau (MT-bench both turns + ShareGPT) | mean over prompts ± s.e. | MT-bench t1 / t2 | "
             "ShareGPT | acceptance at 1..K | outputs = target-only | CPU s/step | wall s/step (beside others) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = (served or {}).get("drafters", {}).get(r["name"])
        speeds = f"{peer.fmt(r.get('cpu_s_per_step'))} | {peer.fmt(r.get('step_s_median'))}"
        if not s:
            lines.append(f"| {r['name']} | {r.get('steps')} | - | - | - | - | - | - | {speeds} |")
            continue
        by, over = {k: v["pooled"] for k, v in s["by_set"].items()}, s["over_prompts"]
        lines.append(f"| {r['name']} | {r.get('steps')} | {s['tau']:.3f} | {over['mean']:.3f} ± {over['se']:.3f} | "
                     f"{peer.fmt(by.get('mtbench_turn1'), '.3f')} / {peer.fmt(by.get('mtbench_turn2'), '.3f')} | "
                     f"{peer.fmt(by.get('sharegpt'), '.3f')} | {' '.join(f'{a:.3f}' for a in s['acceptance_rate_per_position'])} | "
                     f"{s['outputs_match_target_only']} | {speeds} |")
    if difference:
        lines += ["", f"ours - speculators, tau per prompt (same prompts, same target outputs): {difference['mean']:+.3f} "
                      f"± {difference['se']:.3f} (s.e., {difference['n']} prompts; {difference['ours_higher']} higher, "
                      f"{difference['ours_lower']} lower)"]
    return "\n".join(lines)


def paired_difference(served: dict) -> dict:
    ours, theirs = (served["drafters"][a]["tau_per_prompt"] for a in ARMS)
    return paired(ours, theirs) | {"ours_higher": sum(a > b for a, b in zip(ours, theirs)),
                                        "ours_lower": sum(a < b for a, b in zip(ours, theirs))}


def bench(cfg: DSparkPeerConfig) -> Path:
    pcfg = peer_config(cfg)
    if cfg.train:
        peer.check_peer_venv(pcfg, ["peer_matched"])  # speculators' venv: made now, or one line on how
    peer.register_pid(pcfg)
    out = peer.root_path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    folders = {arm: train_arm(cfg, arm) if cfg.train else run_dir(cfg, arm) for arm in ARMS}
    folders = {arm: f for arm, f in folders.items() if (f / "export" / "config.json").is_file()}
    rows = [record(cfg, arm, folder) for arm, folder in folders.items()]
    served = peer.served_results(pcfg, folders, out)
    difference = paired_difference(served) if served and len(folders) == len(ARMS) else None
    result = {"config": asdict(cfg), "rows": rows, "served": served, "ours_minus_speculators": difference,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
              "git_revision": git_revision()}
    (out / "peer_dspark.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "peer_dspark.md").write_text(markdown(rows, served, difference) + "\n")
    print(markdown(rows, served, difference))
    print(f"table: {out / 'peer_dspark.md'}")
    return out / "peer_dspark.json"


if __name__ == "__main__":
    run_command("peer_dspark", DSparkPeerConfig, bench, config_dir="conf/benchmarks")
