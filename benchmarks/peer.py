"""Our trainer beside vLLM's speculators 0.9.0 on the same target, rows, split and recipe.

    python -m benchmarks.peer n=384 steps=[120,480] arms=[ours,peer_matched,peer_defaults] seed=0 threads=1

Trains each arm at each step budget, one at a time, each into its own folder under `runs` (a folder that
already holds an export is reused; ours resumes from its last checkpoint), then serves every drafter with
this project's engine on the same prompts (MT-bench, both turns, and ShareGPT's test split) at the same K,
and writes one table (peer.md, peer.json) and one plot (peer.png: tau against tokens trained, a line per arm)
into `out`.

- ours: `python train.py conf=eagle3_smollm2` from scratch (init_from=null) with the recipe written out
  (4 x 512 tokens a step, lr 1e-3, K=5 with decay 0.8, 8,192-token draft vocabulary, layers [2, 15, 27]);
  the target computes the hidden states every step (data.hidden_states=online).
- ours_cached: the same, reading the hidden states from our cache of the same rows (`python -m train.hidden_cache`,
  built once per N like the peer's): the trainers doing the same work a step.
- peer_matched / peer_defaults: vLLM's speculators 0.9.0 through our runner (benchmarks/peers/speculators_peer.py,
  its venv made on demand) with the same N and steps; peer_defaults adds `peer_defaults_extra` (speculators'
  own EAGLE-3 defaults: EAGLE-3.1 norms, muon) and `peer_defaults_env` (its own TTT depth and step decay).
- modelopt: NVIDIA ModelOpt 0.47's EAGLE-3 through benchmarks/peers/modelopt_peer.py (online: the target inside
  every step), the same rows, steps and recipe where ModelOpt lets it be set.

Every training runs at niceness `nice`, OMP_NUM_THREADS=threads, under /usr/bin/time -v (peak RSS, CPU seconds).
Speeds are medians over 10-step windows of the training's CPU seconds (sampled from /proc against the step its
log reports), so neither a pause (SIGSTOP by a benchmark beside) nor others' jobs on the core count; the
trainers' own wall seconds a step are reported beside. threads > 1 is a throughput measurement: it waits for
`quiet_lock` to be free and holds it while training. Every heavy step waits while `quiet_lock` exists.
The peer's rows and hidden states are made once per N by the runner (peer_prepare), timed apart.
"""

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks import peers
from benchmarks.peers.records import cache_record, ours_record, peer_prepare_record, peer_record, safetensors_tokens
from benchmarks.peers.timed_runs import (
    STEP_LINES,
    run_logged,
    wait_quiet,
)
from benchmarks.tables import paired, spread  # noqa: F401 (peer.paired, peer.spread)
from common.config import PROJECT_ROOT, UserError, at_least, require, run_command
from forge_kernels.provenance import git_revision, machine

ARMS = ("ours", "ours_cached", "peer_matched", "peer_defaults", "modelopt")
OUR_ARMS = ("ours", "ours_cached")
PEER_ARMS = ("peer_matched", "peer_defaults")  # vLLM's speculators
MODELOPT_ARMS = ("modelopt",)


@dataclass
class PeerBenchConfig:
    """conf/benchmarks/peer.yaml."""

    n: int = 384  # the first N conversations of data/sharegpt-smollm2 (our data.max_examples)
    steps: list[int] = field(default_factory=lambda: [120])  # optimizer steps: one trained drafter per arm and budget
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    seed: int = 0
    threads: int = 1  # OMP/torch threads of every training and of serving
    trained_threads: int | None = None  # train=false: serve the arms trained at this many threads (None: threads)
    peer_dir: str | None = None  # where the peers' work-N folders (rows, hidden states) go; None: beside each runner's venv
    install: bool = True  # make a peer's venv on first use (false: one line on how instead)
    # speculators' own EAGLE-3 defaults (speculators/train/config/schema.py) that the runner sets to our recipe:
    peer_defaults_extra: str = ("--norm-before-fc --norm-output --norm-before-residual --optimizer muon --weight-decay 0.01 "
                                "--ttt-step-loss-decay 1.0 --scheduler-type linear")
    peer_defaults_env: dict[str, str] = field(default_factory=lambda: {"TTT": "3", "ADAMW_BETAS": "0.9,0.999"})
    ours_overrides: list[str] = field(default_factory=list)  # more `train.py` overrides for ours (the recipe's keys)
    peer_extra: str = ""  # more `speculators train` flags for both peer arms, e.g. --hidden-states-dtype float32
    depth_key: str = "drafter.depth"  # our recipe's key for the training depth K
    depth: int = 5  # K trained by every arm (the runner's TTT)
    runs: str = "runs/peer_speculators"  # trained arms: <runs>/<arm>/n<N>_s<steps>_seed<seed>[_t<threads>]
    out: str = "results/smollm2/peer_speculators"
    hidden_cache: bool = True  # also build our hidden-state cache of the same rows once: its tokens/s and bytes
    train: bool = True  # false: report on the arms already trained, train nothing
    serve: bool = True
    k: int = 3  # K served for every drafter (speculators' default depth is 3)
    max_new_tokens: int = 64
    mtbench_conversations: int = 12  # both turns of each
    sharegpt_conversations: int = 12
    quant: str = "gguf"  # the target as served (both arms trained against the Q4_1 file's weights)
    tau_goal: float | None = None  # CPU seconds to reach this tau; None: the highest tau every arm reached
    nice: int = 10
    quiet_lock: str = "/tmp/quiet.lock"
    pids_file: str = "/tmp/background.pids"

    def __post_init__(self):
        for arm in self.arms:
            require(arm in ARMS, "arms", self.arms, f"a list of {', '.join(ARMS)}")
        require(bool(self.steps) and all(s >= 1 for s in self.steps), "steps", self.steps, "a list of budgets >= 1")
        at_least(1, n=self.n, threads=self.threads, depth=self.depth, k=self.k, max_new_tokens=self.max_new_tokens)
        require(self.trained_threads is None or (self.trained_threads >= 1 and not self.train), "trained_threads",
                self.trained_threads, "null, or >= 1 with train=false (it names trained arms, it trains nothing)")
        at_least(0, mtbench_conversations=self.mtbench_conversations, sharegpt_conversations=self.sharegpt_conversations)


def root_path(path: str) -> Path:
    p = Path(path)
    return (p if p.is_absolute() else PROJECT_ROOT / p).resolve()


def peer_work(cfg: PeerBenchConfig) -> Path:
    """The speculators peer's rows and hidden states of the first N conversations (made once per N)."""
    from benchmarks.peers import speculators_peer

    return (Path(cfg.peer_dir) / f"work-{cfg.n}") if cfg.peer_dir else speculators_peer.work_dir(cfg.n)


def check_peer_venv(cfg: PeerBenchConfig, arms: list[str]) -> None:
    """Each peer venv the arms need: made now (install=true), else one line on how."""
    from benchmarks.peers import modelopt_peer, speculators_peer

    for module, kind in ((speculators_peer, PEER_ARMS), (modelopt_peer, MODELOPT_ARMS)):
        if any(a in kind for a in arms):
            module.VENV.ensure(cfg.install)


def training_threads(cfg: PeerBenchConfig) -> int:
    return cfg.trained_threads or cfg.threads


def run_dir(cfg: PeerBenchConfig, arm: str, steps: int) -> Path:
    suffix = f"_t{training_threads(cfg)}" if training_threads(cfg) != 1 else ""
    return root_path(cfg.runs) / arm / f"n{cfg.n}_s{steps}_seed{cfg.seed}{suffix}"


# Commands -------------------------------------------------------------------------------------------------------

def ours_command(cfg: PeerBenchConfig, steps: int, folder: Path, cache_dir: Path | None = None) -> list[str]:
    """Our arm, from scratch, the recipe of conf/eagle3_smollm2.yaml written out (the peer matches these);
    with `cache_dir`, the hidden states read from our cache instead of the target running every step."""
    hidden = ["data.hidden_states=online"] if cache_dir is None else ["data.hidden_states=cache", f"data.cache_dir={cache_dir}"]
    recipe = ["conf=eagle3_smollm2", *hidden, "drafter.family=eagle3", f"{cfg.depth_key}={cfg.depth}", "drafter.step_decay=0.8"]
    return peers.train_command(recipe, cfg.n, steps, cfg.threads, cfg.seed, cfg.ours_overrides, folder)


def cache_command(cfg: PeerBenchConfig, cache_dir: Path) -> list[str]:
    return [sys.executable, "-m", "train.hidden_cache", "conf=eagle3_smollm2", "init_from=null", f"data.max_examples={cfg.n}",
            "data.skip_examples=0", "data.seq_len=512", "data.batch_size=4", "target.layer_ids=[2,15,27]",
            "data.hidden_states=cache", f"data.cache_dir={cache_dir}", f"trainer.num_threads={cfg.threads}"]


def peer_command(cfg: PeerBenchConfig, arm: str, steps: int, folder: Path) -> tuple[list[str], dict[str, str]]:
    """The runner with its WORK in `folder`/work (it wipes WORK/ckpt: runs side by side need one each), whose
    data/ links to the rows and hidden states made once per N (the runner reuses what it finds there); the
    modelopt arm's runner makes its own rows in its WORK (its target runs inside every step)."""
    if arm in MODELOPT_ARMS:
        return [sys.executable, "-m", "benchmarks.peers.modelopt_peer", str(cfg.n), str(steps), str(folder / "export"),
                str(folder / "work")], {"SEED": str(cfg.seed), "TTT": str(cfg.depth)}
    env = {"SEED": str(cfg.seed), "TTT": str(cfg.depth), "EXTRA": cfg.peer_extra}
    if arm == "peer_defaults":
        env |= {"EXTRA": f"{cfg.peer_defaults_extra} {cfg.peer_extra}".strip()} | dict(cfg.peer_defaults_env)
    return [sys.executable, "-m", "benchmarks.peers.speculators_peer", str(cfg.n), str(steps), str(folder / "export"),
            str(folder / "work")], env


def link_peer_data(cfg: PeerBenchConfig, folder: Path) -> None:
    data = folder / "work" / "data"
    if not data.exists():
        data.parent.mkdir(parents=True, exist_ok=True)
        data.symlink_to(peer_work(cfg) / "data")


def train_once(cfg: PeerBenchConfig, folder: Path, label: str, ours: bool,
               command: Callable[[], tuple[list[str], dict[str, str]]]) -> Path:
    """One arm trained into `folder` by `command()`'s arguments and environment, logged and timed; an export
    already there is reused (`command` is not called)."""
    if (folder / "export" / "config.json").is_file():
        print(f"{label}: {folder / 'export'} exists, reused", flush=True)
        return folder
    print(f"{label} -> {folder}", flush=True)
    args, env = command()
    run_logged(cfg, args, env, folder, "train", STEP_LINES["ours" if ours else "peer"])
    return folder


def train_arm(cfg: PeerBenchConfig, arm: str, steps: int) -> Path:
    folder = run_dir(cfg, arm, steps)

    def command() -> tuple[list[str], dict[str, str]]:
        if arm in OUR_ARMS:
            cache_dir = build_cache(cfg) / "cache" if arm == "ours_cached" else None
            return ours_command(cfg, steps, folder, cache_dir), {}
        check_peer_venv(cfg, [arm])
        if arm in PEER_ARMS:
            link_peer_data(cfg, folder)
        return peer_command(cfg, arm, steps, folder)

    return train_once(cfg, folder, f"{arm} at {steps} steps", arm in OUR_ARMS, command)


def peer_prepare(cfg: PeerBenchConfig) -> Path:
    """The speculators peer's offline stages on their own (the runner with STEPS=0: rows, then hidden states),
    timed: each training then finds them in its WORK/data and reuses them, so its log holds training only.
    The CPU seconds of this stage include the rows' (a few seconds against the hidden states' minutes)."""
    folder = root_path(cfg.runs) / "peer_hidden" / f"n{cfg.n}"
    if (folder / "hidden.done").is_file():
        return folder
    check_peer_venv(cfg, list(PEER_ARMS))
    print(f"the peer's rows and hidden states of the first {cfg.n} conversations -> {peer_work(cfg) / 'data'}", flush=True)
    run_logged(cfg, [sys.executable, "-m", "benchmarks.peers.speculators_peer", str(cfg.n), "0", "-", str(peer_work(cfg))],
               {}, folder, "hidden")
    (folder / "hidden.done").write_text("")
    return folder


def build_cache(cfg: PeerBenchConfig) -> Path:
    folder = root_path(cfg.runs) / "ours_cache" / f"n{cfg.n}"
    if not (folder / "cache" / "index.json").is_file():
        print(f"our hidden-state cache of the same rows -> {folder}", flush=True)
        run_logged(cfg, cache_command(cfg, folder / "cache"), {}, folder, "cache")
    return folder


def peer_disk(cfg: PeerBenchConfig) -> dict:
    folder = peer_work(cfg) / "data" / "hidden_states"
    files = sorted(folder.glob("hs_*.safetensors"))
    if not files:
        return {}
    size = sum(f.stat().st_size for f in files)
    tokens = sum(safetensors_tokens(f) for f in files)
    return {"bytes": size, "tokens": tokens, "bytes_per_token": size / tokens, "files": len(files)}


def peer_split(cfg: PeerBenchConfig) -> dict | None:
    path = peer_work(cfg) / "data" / "split.json"
    return json.loads(path.read_text()) if path.is_file() else None


# Serving -------------------------------------------------------------------------------------------------------

def serve(cfg: PeerBenchConfig, drafters: dict[str, Path]) -> dict:
    """Every drafter (and target-only decoding) on the same prompts with the same K, interleaved prompt by
    prompt; per prompt tau = 1 + accepted / drafts, so the spread over prompts is known."""
    import torch

    from benchmarks import rounds
    from benchmarks.compare import tau_standard_error, vocabulary_coverage
    from inference import evalsets, report
    from inference.drafting import DraftingConfig
    from inference.engine import Stats, generate
    from speculators.quant import QuantConfig

    torch.set_num_threads(cfg.threads)
    names = list(drafters)
    served, target = report.load_drafters([str(drafters[name]) for name in names], None, QuantConfig(cfg.quant))
    loaded = dict(zip(names, served))
    prompts = []
    for set_name, count, turns in (("mtbench", cfg.mtbench_conversations, 2), ("sharegpt", cfg.sharegpt_conversations, 1)):
        if count:  # 0: the set left out
            ecfg = evalsets.EvalConfig(set_name, num_prompts=count, turns=turns)
            prompts += [(set_name, p) for p in evalsets.prompts(ecfg, target, cfg.max_new_tokens)]
    ways = {"target_only": lambda ids: generate(target, None, ids, cfg.max_new_tokens, 0)}
    for name in names:
        ways[name] = (lambda d: lambda ids: generate(target, d, ids, cfg.max_new_tokens, cfg.k,
                                                     drafting=DraftingConfig()))(loaded[name])
    timed = rounds.interleaved(ways, [p.ids for _, p in prompts], 1, count=lambda out, wall: (len(out.tokens), wall))
    base_speed = timed["target_only"].tokens[0] / timed["target_only"].seconds[0]
    base_outputs = [out.tokens for out in timed["target_only"].results]
    result = {"prompts": [{"set": s, "turn": p.turn, "tokens": len(p.ids)} for s, p in prompts], "drafters": {}}
    for name in names:
        outs = timed[name].results
        per_prompt = [out.stats.acceptance_length for out in outs]
        total = Stats(cfg.k)
        for out in outs:
            total.add(out.stats)
        by_set = {}
        for set_name in {s for s, _ in prompts} | {"mtbench_turn1", "mtbench_turn2"}:
            idx = [i for i, (s, p) in enumerate(prompts) if s == set_name or f"{s}_turn{p.turn}" == set_name]
            if idx:
                by_set[set_name] = spread([per_prompt[i] for i in idx]) | {"pooled": pooled([outs[i] for i in idx], cfg.k)}
        result["drafters"][name] = {
            "path": str(drafters[name]), "tau": total.acceptance_length,
            "tau_stderr_drafts": tau_standard_error(total.accepted_at, total.num_drafts),
            "tau_per_prompt": per_prompt, "over_prompts": spread(per_prompt), "by_set": by_set,
            "acceptance_rate_per_position": total.acceptance_rates,
            "draft_vocabulary_coverage": vocabulary_coverage(loaded[name], base_outputs),
            "tokens_per_s": timed[name].tokens[0] / timed[name].seconds[0],
            "speedup": timed[name].tokens[0] / timed[name].seconds[0] / base_speed,
            "outputs_match_target_only": [out.tokens for out in outs] == base_outputs}
    result["target_only_tokens_per_s"] = base_speed
    return result


def pooled(outs: list, k: int) -> float:
    from inference.engine import Stats

    total = Stats(k)
    for out in outs:
        total.add(out.stats)
    return total.acceptance_length


# Table and plot ------------------------------------------------------------------------------------------------

def rows_of(records: list[dict], served: dict | None) -> list[dict]:
    """One row per arm and budget: training figures beside the served tau."""
    rows = []
    for rec in records:
        row = dict(rec)
        row["tokens_trained"] = rec["steps"] * rec["tokens_per_step"] if rec.get("tokens_per_step") else None
        step_s, cpu_s = rec.get("step_s_median"), rec.get("cpu_s_per_step")
        row["train_tokens_per_s"] = rec["tokens_per_step"] / step_s if step_s and rec.get("tokens_per_step") else None
        row["train_tokens_per_cpu_s"] = rec["tokens_per_step"] / cpu_s if cpu_s and rec.get("tokens_per_step") else None
        s = (served or {}).get("drafters", {}).get(rec["name"])
        if s:
            row |= {"tau": s["tau"], "tau_stderr_drafts": s.get("tau_stderr_drafts"),
                    "acceptance_rate_per_position": s.get("acceptance_rate_per_position"), "tau_sd_prompts": s["over_prompts"]["sd"], "tau_se_prompts": s["over_prompts"]["se"],
                    "tau_mean_prompts": s["over_prompts"]["mean"], "speedup": s["speedup"],
                    "outputs_match": s["outputs_match_target_only"],
                    "tau_by_set": {k: v["pooled"] for k, v in s["by_set"].items()}}
        rows.append(row)
    return rows


def time_to_tau(rows: list[dict], goal: float | None, hidden_s: dict[str, float]) -> dict:
    """Per arm: training CPU seconds (median CPU seconds a step x steps, plus the arm's one-off hidden-state pass;
    at one thread about the wall time on an idle core) of the smallest budget whose tau reached `goal`;
    goal None: the highest tau that every arm reached."""
    arms = sorted({r["arm"] for r in rows if r.get("tau") is not None})
    if not arms:
        return {}
    if goal is None:
        goal = min(max(r["tau"] for r in rows if r["arm"] == a and r.get("tau") is not None) for a in arms)
    out = {"goal": goal}
    for arm in arms:
        hits = sorted((r["steps"], r) for r in rows if r["arm"] == arm and r.get("tau") is not None and r["tau"] >= goal)
        if hits and hits[0][1].get("cpu_s_per_step"):
            r = hits[0][1]
            out[arm] = {"steps": r["steps"], "seconds": round(r["cpu_s_per_step"] * r["steps"] + hidden_s.get(arm, 0.0))}
        else:
            out[arm] = None
    return out


def fmt(x, spec: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def markdown(rows: list[dict], extra: dict) -> str:
    lines = ["| arm | steps | tokens trained | tau (MT-bench both turns + ShareGPT) ± sd over prompts (s.e.) | MT-bench t1 / t2 | "
             "ShareGPT | acceptance at 1..K | CPU s/step | tokens/CPU-s | wall s/step (median) | peak RSS GiB | CPU s (process) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        by = r.get("tau_by_set") or {}
        tau = "-" if r.get("tau") is None else f"{r['tau']:.3f} ± {r['tau_sd_prompts']:.2f} ({r['tau_se_prompts']:.3f})"
        lines.append(f"| {r['name']} | {r['steps']} | {fmt(r.get('tokens_trained'), ',.0f')} | {tau} | "
                     f"{fmt(by.get('mtbench_turn1'), '.3f')} / {fmt(by.get('mtbench_turn2'), '.3f')} | {fmt(by.get('sharegpt'), '.3f')} | "
                     f"{' '.join(f'{a:.3f}' for a in r.get('acceptance_rate_per_position') or []) or '-'} | {fmt(r.get('cpu_s_per_step'))} | {fmt(r.get('train_tokens_per_cpu_s'), '.0f')} | "
                     f"{fmt(r.get('step_s_median'))} | "
                     f"{fmt(r.get('peak_rss_gib'))} | {fmt(r.get('cpu_s'), '.0f')} |")
    for title, block in extra.items():
        lines += ["", f"**{title}**", "", "```", json.dumps(block, indent=1), "```"]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    from common import plots

    with plots.figure(path, (6, 4)) as ax:
        for arm in sorted({r["arm"] for r in rows}):
            pts = sorted((r["tokens_trained"], r["tau"], r.get("tau_se_prompts") or 0) for r in rows
                         if r["arm"] == arm and r.get("tau") is not None and r.get("tokens_trained"))
            if pts:
                xs, ys, es = zip(*pts)
                ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=arm)
        ax.set(xscale="log", xlabel="tokens trained (non-padding)", ylabel="tau (served, greedy)",
               title="tau against tokens trained (± s.e. over prompts)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


# The command ---------------------------------------------------------------------------------------------------

def register_pid(cfg: PeerBenchConfig) -> None:
    """The benchmark beside SIGSTOPs/SIGCONTs what this file lists: our process group (children included)."""
    try:
        if os.getpgrp() == os.getpid():
            with open(cfg.pids_file, "a") as f:
                f.write(f"{os.getpid()}\n")
    except OSError:
        pass


def served_results(cfg: PeerBenchConfig, folders: dict[str, Path], out: Path) -> dict | None:
    """Each drafter's serving results, kept per drafter (out/served/<name>_<settings>.json) so a later run serves
    only drafters not served yet: greedy tau per prompt is the same in any run, and each file keeps the
    target-only speed of the run that served it (its speed-up is against that)."""
    if not cfg.serve or not folders:
        return None
    settings = f"k{cfg.k}_m{cfg.mtbench_conversations}_s{cfg.sharegpt_conversations}_t{cfg.max_new_tokens}_th{cfg.threads}"
    store = out / "served"
    store.mkdir(parents=True, exist_ok=True)
    path_of = {name: store / f"{name.replace('@', '_')}_{settings}.json" for name in folders}
    missing = {}
    for name, folder in folders.items():
        kept = json.loads(path_of[name].read_text()) if path_of[name].is_file() else None
        if not kept or kept["drafter"]["path"] != str(folder / "export"):
            missing[name] = folder / "export"
    if missing:
        wait_quiet(cfg)
        result = serve(cfg, missing)
        for name in missing:
            path_of[name].write_text(json.dumps({"drafter": result["drafters"][name], "prompts": result["prompts"],
                                                 "target_only_tokens_per_s": result["target_only_tokens_per_s"],
                                                 "served_with": sorted(missing)}, indent=1))
    served = {"drafters": {}, "target_only_tokens_per_s": {}, "prompts": None}
    for name in folders:
        kept = json.loads(path_of[name].read_text())
        served["drafters"][name] = kept["drafter"]
        served["target_only_tokens_per_s"][name] = kept["target_only_tokens_per_s"]
        if served["prompts"] is None:
            served["prompts"] = kept["prompts"]
        elif served["prompts"] != kept["prompts"]:
            raise UserError(f"{path_of[name]} was served on other prompts; delete it to serve it again")
    return served


def bench(cfg: PeerBenchConfig) -> Path:
    if cfg.train:
        check_peer_venv(cfg, cfg.arms)  # made (or one line), before anything trains
    register_pid(cfg)
    out = root_path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    prepared = peer_prepare(cfg) if cfg.train and any(a in PEER_ARMS for a in cfg.arms) else None
    if prepared is None and (root_path(cfg.runs) / "peer_hidden" / f"n{cfg.n}" / "hidden.done").is_file():
        prepared = root_path(cfg.runs) / "peer_hidden" / f"n{cfg.n}"
    folders = {}
    for steps in sorted(cfg.steps):
        for arm in cfg.arms:
            folder = run_dir(cfg, arm, steps)
            if cfg.train:
                folders[f"{arm}@{steps}"] = train_arm(cfg, arm, steps)
            elif (folder / "export" / "config.json").is_file():
                folders[f"{arm}@{steps}"] = folder
            else:
                print(f"{arm} at {steps} steps: not trained (train=false), left out", flush=True)
    split = peer_split(cfg)
    records = []
    for name, folder in folders.items():
        arm = name.split("@")[0]
        rec = ours_record(folder, split) if arm in OUR_ARMS else peer_record(folder, arm in MODELOPT_ARMS)
        records.append(rec | {"name": name, "arm": arm, "folder": str(folder), "threads": training_threads(cfg),
                              "command": (folder / "train.cmd").read_text().strip() if (folder / "train.cmd").is_file() else None})
    served = served_results(cfg, folders, out)
    cache = build_cache(cfg) if cfg.hidden_cache or "ours_cached" in cfg.arms else None
    rows = rows_of(records, served)
    hidden = {"peer": peer_disk(cfg) | peer_prepare_record(prepared), "ours_cache": cache_record(cache) if cache else {}}
    one_off = {arm: hidden["peer"].get("cpu_s") or 0.0 for arm in PEER_ARMS} | {"ours_cached": hidden["ours_cache"].get("cpu_s") or 0.0}
    extra = {"hidden states": hidden, "time to tau (CPU seconds, 1 thread)": time_to_tau(rows, cfg.tau_goal, one_off)}
    if served:
        ours = next((a for a in OUR_ARMS if any(r["arm"] == a for r in rows)), "ours")
        base = {r["steps"]: served["drafters"][r["name"]]["tau_per_prompt"] for r in rows if r["arm"] == ours}
        extra[f"paired tau difference vs {ours} (same prompts), mean ± s.e."] = {
            r["name"]: paired(served["drafters"][r["name"]]["tau_per_prompt"], base[r["steps"]])
            for r in rows if r["arm"] != ours and r["steps"] in base}
    for measure, key in (("CPU-second", "train_tokens_per_cpu_s"), ("second of wall time", "train_tokens_per_s")):
        label = f"training tokens per {measure}, ours / peer, {training_threads(cfg)} thread(s)"
        extra[label] = speed_ratios(rows, key, cfg.steps)
    result = {"config": asdict(cfg), "rows": rows, **extra, "served": served,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(), "git_revision": git_revision()}
    stem = "peer" if cfg.threads == 1 else f"peer_t{cfg.threads}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    (out / f"{stem}.md").write_text(markdown(rows, extra) + "\n")
    if served:
        plot(rows, out / f"{stem}.png")
    print(markdown(rows, extra))
    print(f"table: {out / f'{stem}.md'}")
    return out / f"{stem}.json"


def speed_ratios(rows: list[dict], key: str, budgets: list[int]) -> dict:
    """Each of our arms' `key` over each peer arm's at the same budget. Per CPU-second is the figure beside other
    jobs; per wall second the one with nothing beside (at 2 threads, what a user waits for)."""
    speed = {(r["arm"], r["steps"]): r.get(key) for r in rows}
    return {f"{ours}/{peer}@{steps}": speed[ours, steps] / speed[peer, steps]
            for ours in OUR_ARMS for peer in PEER_ARMS + MODELOPT_ARMS for steps in sorted(budgets)
            if speed.get((ours, steps)) and speed.get((peer, steps))}


if __name__ == "__main__":
    run_command("peer", PeerBenchConfig, bench, config_dir="conf/benchmarks")
