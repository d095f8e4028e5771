"""Trainings run as measurements: at a niceness, under /usr/bin/time -v, their CPU seconds sampled from /proc
against the step each logs, so neither a pause nor others' jobs on the core count; and the figures read back
(CPU and wall seconds a step, peak RSS)."""

import os
import re
import shlex
import statistics
import subprocess
import time
from pathlib import Path
from typing import Protocol

from common.config import PROJECT_ROOT, UserError


class RunSettings(Protocol):
    """What a measured run reads of its benchmark's settings."""

    threads: int  # OMP/MKL threads of the run
    nice: int  # its niceness
    quiet_lock: str  # a file: wait while it exists; held while a run with threads > 1 measures throughput


def shell_line(args: list[str], env: dict[str, str]) -> str:
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, args)])


def wait_quiet(cfg: RunSettings) -> None:
    """Start nothing heavy while someone else benchmarks (their lock file exists)."""
    said = False
    while Path(cfg.quiet_lock).exists():
        if not said:
            print(f"waiting for {cfg.quiet_lock} to go (polling every 30 s)", flush=True)
            said = True
        time.sleep(30)


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and its live descendants, with the children each has waited for (Linux /proc):
    a pause or a busy machine adds wall time, not CPU time."""
    tick, total, todo = os.sysconf("SC_CLK_TCK"), 0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue  # exited meanwhile: its parent's cutime/cstime hold it once waited for
    return total / tick


STEP_LINES = {"ours": re.compile(rb"^step (\d+)/\d+ ", re.M),
              "peer": re.compile(rb"global_step=(\d+)")}  # speculators' per-step metrics (--log-freq 1), before its increment


def last_step(log: Path, pattern: re.Pattern) -> int | None:
    try:
        with open(log, "rb") as f:
            f.seek(max(0, log.stat().st_size - 65536))
            tail = f.read()
    except OSError:
        return None
    found = [next(int(g) for g in m.groups() if g) for m in pattern.finditer(tail)]
    return found[-1] if found else None


def trace_cpu(proc: subprocess.Popen, log: Path, pattern: re.Pattern, trace: Path, every: float = 2.0) -> None:
    """Every `every` seconds until `proc` ends: wall time, the tree's CPU seconds and the last step logged."""
    with open(trace, "a") as out:
        out.write("### a new process: its CPU seconds count from 0\n")
        while proc.poll() is None:
            out.write(f"{time.time():.2f}\t{tree_cpu_seconds(proc.pid):.2f}\t{last_step(log, pattern)}\n")
            out.flush()
            time.sleep(every)


def cpu_step_seconds(trace: Path, window: int = 10) -> list[float]:
    """CPU seconds per training step over windows of `window` steps, from trace_cpu's samples: the first sample
    at which each step was logged. A resumed run appends a new process's samples ("### " line) to the same file;
    windows never span two processes."""
    if not trace.is_file():
        return []
    out = []
    for segment in ("\n" + trace.read_text()).split("\n### "):
        first_seen = {}
        for line in segment.splitlines():
            parts = line.split("\t")
            if len(parts) == 3 and parts[2] != "None" and int(parts[2]) not in first_seen:
                first_seen[int(parts[2])] = float(parts[1])
        picked = []
        for step in sorted(first_seen):
            if not picked or step - picked[-1] >= window:
                picked.append(step)
        out += [(first_seen[b] - first_seen[a]) / (b - a) for a, b in zip(picked, picked[1:]) if first_seen[b] > first_seen[a]]
    return out


def run_logged(cfg: RunSettings, args: list[str], env: dict[str, str], folder: Path, name: str,
               steps: re.Pattern | None = None) -> float:
    """Run `args` in the project root at niceness `nice` under /usr/bin/time -v; stdout+stderr to <folder>/<name>.log,
    the command to <name>.cmd, time's report to <name>.time and (given a step pattern) CPU seconds against the
    step logged to <name>.cpu.tsv. Returns wall seconds (pauses included)."""
    folder.mkdir(parents=True, exist_ok=True)
    threads = str(cfg.threads)
    full_env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, **env}
    line = shell_line(args, {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, **env})
    env_part, cmd_part = shell_line([], {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, **env}), shell_line(args, {})
    (folder / f"{name}.cmd").write_text(f"cd {PROJECT_ROOT} && {env_part} nice -n {cfg.nice} {cmd_part}\n")
    wait_quiet(cfg)
    lock = None
    if cfg.threads > 1:  # a deliberate throughput measurement: hold the lock others wait on
        lock = Path(cfg.quiet_lock)
        lock.touch()
    started = time.time()
    increment = max(0, cfg.nice - os.nice(0))  # to niceness `nice`, whatever this process runs at
    try:
        with open(folder / f"{name}.log", "ab") as log:
            log.write(f"\n### {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {line}\n".encode())
            log.flush()
            proc = subprocess.Popen(["nice", "-n", str(increment), "/usr/bin/time", "-v", "-o",
                                     str(folder / f"{name}.time"), *args],
                                    cwd=PROJECT_ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT)
            if steps is not None:
                trace_cpu(proc, folder / f"{name}.log", steps, folder / f"{name}.cpu.tsv")
            returncode = proc.wait()
    finally:
        if lock is not None:
            lock.unlink(missing_ok=True)
    if returncode:
        raise UserError(f"{name} failed (exit {returncode}): see {folder / f'{name}.log'}")
    return time.time() - started


def time_report(path: Path) -> dict:
    """/usr/bin/time -v's figures: peak RSS, CPU and wall seconds."""
    if not path.is_file():
        return {}
    text = path.read_text()

    def field_(label: str) -> str | None:
        m = re.search(rf"^\s*{re.escape(label)}: (.+)$", text, re.M)
        return m.group(1).strip() if m else None

    wall = field_("Elapsed (wall clock) time (h:mm:ss or m:ss)")
    seconds = None
    if wall:
        parts = [float(p) for p in wall.split(":")]
        seconds = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
    rss = field_("Maximum resident set size (kbytes)")
    user, system = field_("User time (seconds)"), field_("System time (seconds)")
    return {"peak_rss_gib": int(rss) / 2**20 if rss else None, "wall_s": seconds,
            "cpu_s": float(user) + float(system) if user and system else None}


def ours_step_seconds(log: str, window: int = 10) -> list[float]:
    """Seconds per step in windows of `window` steps, from ProgressLines ("step i/S ... a s/step", a the mean
    since training (re)started, logged every step): elapsed(i) = (i - i0) * a(i), and a window's time is the
    difference of two elapsed times (the 2-decimal rounding of a then costs < 0.01 s/step at 10-step windows).
    A pause lands in one window. A resumed run (a new "### " command line in the log) starts new means."""
    runs, points, start = [], [], None
    for line in log.splitlines():
        if line.startswith("### "):
            runs.append(points)
            points, start = [], None
            continue
        m = re.match(r"step (\d+)/\d+\s.*?([\d.]+) s/step", line)
        if m:
            step, mean = int(m.group(1)), float(m.group(2))
            start = step - 1 if start is None else start  # logged every step: the first line is one past the start
            points.append((step, (step - start) * mean))
    runs.append(points)
    return [(e1 - e0) / (s1 - s0) for pts in runs for (s0, e0), (s1, e1) in zip(pts[::window], pts[window::window])]


def cpu_figures(folder: Path) -> dict:
    """From <folder>/train.cpu.tsv: median CPU seconds per step (10-step windows) and the CPU spent before the
    first step was logged (loading, data; the peer's rows and hidden states when its run computed them)."""
    trace = folder / "train.cpu.tsv"
    windows = cpu_step_seconds(trace)
    rec = {"cpu_s_per_step": statistics.median(windows) if windows else None, "cpu_windows": len(windows)}
    if trace.is_file():
        for line in trace.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 3 and parts[2] != "None":
                rec["setup_cpu_s"] = float(parts[1])
                break
    return rec
