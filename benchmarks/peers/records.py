"""What each trained arm's folder says about it: steps, tokens and seconds a step, CPU, peak memory, and the
hidden states it trained from (benchmarks/peer.py and dspark_bench.py read their arms through these)."""

import json
import re
import statistics
from pathlib import Path

from benchmarks.peers.timed_runs import cpu_figures, ours_step_seconds, time_report


def peer_prepare_record(folder: Path | None) -> dict:
    if folder is None or not (folder / "hidden.log").is_file():
        return {}
    rec = {"cpu_s": time_report(folder / "hidden.time").get("cpu_s"), "wall_s": time_report(folder / "hidden.time").get("wall_s"),
           "peak_rss_gib": time_report(folder / "hidden.time").get("peak_rss_gib")}
    h = re.findall(r"hidden states: (\d+) rows, (\d+) tokens in ([\d.]+) s", (folder / "hidden.log").read_text())
    if h and int(h[-1][0]):
        rows, tokens, seconds = h[-1]
        rec |= {"rows": int(rows), "tokens": int(tokens), "tokens_per_s_wall": int(tokens) / float(seconds)}
        if rec["cpu_s"]:
            rec["tokens_per_cpu_s"] = int(tokens) / rec["cpu_s"]  # the target's load included
    return rec


def ours_record(folder: Path, peer_split: dict | None) -> dict:
    log = (folder / "train.log").read_text(errors="replace") if (folder / "train.log").is_file() else ""
    training = json.loads((folder / "export" / "training.json").read_text())
    rows = re.search(r"data train: .*?; (\d+) rows of (\d+) tokens, (\d+)% of them trained", log)
    per_step = ours_step_seconds(log)
    rec = {"arm": folder.parent.name, "steps": training["steps"], "positions_per_step": training["tokens_seen"] / max(training["steps"], 1),
           "train_rows": int(rows.group(1)) if rows else None, "trained_share": int(rows.group(3)) / 100 if rows else None,
           "step_s_median": statistics.median(per_step) if per_step else None, "steps_timed": len(per_step),
           "wall_time_s": training.get("wall_time_s"),
           "hidden_states": "online (the target runs every step)" if folder.parent.name == "ours" else "our cache (built once per N)"}
    # The same examples as the peer's rows (its prep_data.py mirrors train/data.py): their real tokens over our rows.
    if peer_split and rec["train_rows"]:
        rec["tokens_per_step"] = peer_split["train_tokens"] / rec["train_rows"] * 4
        rec["tokens_note"] = "non-padding tokens per step: the train split's tokens (peer's split.json) over our rows x 4"
    else:
        rec["tokens_per_step"] = rec["positions_per_step"]
        rec["tokens_note"] = "positions per step (padding included)"
    return rec | cpu_figures(folder) | time_report(folder / "train.time")


def peer_step_seconds(log: str) -> list[float]:
    """Per-step seconds from speculators' own per-step log lines, when it prints them."""
    return [float(x) / 1000 for x in re.findall(r"profile/step_ms=([\d.]+(?:e[+-]?\d+)?)", log)]


def peer_record(folder: Path, online: bool = False) -> dict:
    """A peer arm's figures from its log; `online`: its target ran every step (ModelOpt)."""
    log = (folder / "train.log").read_text(errors="replace")
    rec = {"arm": folder.parent.name}
    m = re.findall(r"\[train_cpu\] (\d+) steps; seconds/step: first ([\d.]+), mean of the rest ([\d.]+); "
                   r"tokens/step \(packed, prompts included\): (\d+); process ([\d.]+) s", log)
    if m:
        steps, first, rest, tokens, process = m[-1]
        rec |= {"steps": int(steps), "step_s_first": float(first), "step_s_mean": float(rest),
                "tokens_per_step": float(tokens), "process_s": float(process)}
    per_step = peer_step_seconds(log)
    rec["step_s_median"] = statistics.median(per_step[1:] or per_step) if per_step else rec.get("step_s_mean")
    rec["steps_timed"] = len(per_step)
    h = re.findall(r"hidden states: (\d+) rows, (\d+) tokens in ([\d.]+) s", log)
    if h:
        rows, tokens, seconds = h[-1]
        if int(rows):
            rec["hidden_states_tokens_per_s"] = int(tokens) / float(seconds)
            rec["hidden_states_tokens"] = int(tokens)
    secs = re.findall(r"== seconds: rows (\d+), hidden states (\d+), training (\d+)", log)
    if secs:
        rec["stage_seconds"] = dict(zip(("rows", "hidden_states", "training"), map(int, secs[-1])))
    rec["hidden_states"] = "online (the target runs every step)" if online else "offline (computed once per N, bf16 files)"
    return rec | cpu_figures(folder) | time_report(folder / "train.time")


def safetensors_tokens(path: Path) -> int:
    """Rows of a hidden-state file (its first dimension), read from the safetensors header only."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return header["hidden_states"]["shape"][0]


def cache_record(folder: Path) -> dict:
    cache = folder / "cache"
    if not (cache / "index.json").is_file():
        return {}
    size = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    log = (folder / "cache.log").read_text(errors="replace") if (folder / "cache.log").is_file() else ""
    rows = [int(r) for r in re.findall(r"data (?:train|validation): .*?; (\d+) rows of", log)]
    positions = sum(rows) * 512
    timing = time_report(folder / "cache.time")
    rec = {"bytes": size, "rows": sum(rows), "positions": positions,
           "bytes_per_position": size / positions if positions else None} | timing
    if positions and timing.get("cpu_s"):
        rec["positions_per_cpu_s"] = positions / timing["cpu_s"]  # target load included
    return rec
