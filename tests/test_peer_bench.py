"""benchmarks/peer.py without the peer installed: commands, log reading, the table and plot from synthetic
results, and the one-line error when a peer's venv is missing (install=false)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import peer
from benchmarks.peers import records, timed_runs
from common.config import UserError

REPO = Path(__file__).resolve().parent.parent


def cfg(tmp_path, **kw) -> peer.PeerBenchConfig:
    return peer.PeerBenchConfig(peer_dir=str(tmp_path / "peer"), runs=str(tmp_path / "runs"),
                                out=str(tmp_path / "out"), quiet_lock=str(tmp_path / "quiet.lock"),
                                pids_file=str(tmp_path / "pids"), **kw)


def run_cli(*args, cwd=REPO, **extra_env):
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", **extra_env}
    env.pop("SPECULATORS_TRACEBACK", None)
    return subprocess.run([sys.executable, "-m", "benchmarks.peer", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_missing_peer_venv_is_one_line(tmp_path):
    """install=false and no venv: one line naming the venv and the commands that make it, before any training."""
    result = run_cli("install=false", "arms=[peer_matched]", f"runs={tmp_path}/runs", f"out={tmp_path}/out",
                     SPECULATORS_CACHE=str(tmp_path / "cache"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert f"no speculators-0.9.0 venv at {tmp_path}/cache/peers/speculators-0.9.0/venv" in lines[0]
    assert "pip install --quiet --no-deps speculators==0.9.0" in lines[0] and "install=true" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_ours_only_needs_no_peer(tmp_path, monkeypatch):
    from benchmarks.peers import Venv

    monkeypatch.setattr(Venv, "ensure", lambda self, install=True: pytest.fail(f"{self.name} looked for"))
    peer.check_peer_venv(cfg(tmp_path, arms=["ours"]), ["ours", "ours_cached"])


def test_bad_arm_is_refused():
    with pytest.raises(UserError, match="arms"):
        peer.PeerBenchConfig(arms=["ours", "specforge"])


def test_ours_command_trains_from_scratch_with_the_recipe_written_out(tmp_path):
    c = cfg(tmp_path, n=384, depth_key="drafter.depth")
    args = peer.ours_command(c, 120, tmp_path / "run")
    assert "init_from=null" in args and "data.max_examples=384" in args and "trainer.max_steps=120" in args
    assert "drafter.depth=5" in args and "drafter.draft_vocab_size=8192" in args and "data.hidden_states=online" in args
    assert "target.layer_ids=[2,15,27]" in args and "optim.lr=0.001" in args and "trainer.num_threads=1" in args
    assert args[-1] == f"hydra.run.dir={tmp_path / 'run'}" and not any(a.startswith("resume=") for a in args)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "last.ckpt").write_text("")
    assert f"resume={tmp_path / 'run'}" in peer.ours_command(c, 120, tmp_path / "run")
    c.ours_overrides = ["data.hidden_states=cache", "data.cache_dir=/x"]
    args = peer.ours_command(c, 120, tmp_path / "y")
    assert "data.hidden_states=cache" in args and "data.hidden_states=online" not in args and "data.cache_dir=/x" in args
    cached = peer.ours_command(cfg(tmp_path), 120, tmp_path / "z", cache_dir=tmp_path / "cache")  # the ours_cached arm
    assert "data.hidden_states=cache" in cached and f"data.cache_dir={tmp_path / 'cache'}" in cached
    assert "data.hidden_states=online" not in cached
    assert "drafter.num_speculative_tokens=5" in peer.ours_command(cfg(tmp_path, depth_key="drafter.num_speculative_tokens"),
                                                                     120, tmp_path / "x")


def test_peer_command_runs_the_runner(tmp_path):
    c = cfg(tmp_path, seed=3)
    args, env = peer.peer_command(c, "peer_matched", 480, tmp_path / "f")
    assert args == [sys.executable, "-m", "benchmarks.peers.speculators_peer", "384", "480", str(tmp_path / "f" / "export"),
                    str(tmp_path / "f" / "work")]
    assert env == {"SEED": "3", "TTT": "5", "EXTRA": ""}
    args, env = peer.peer_command(c, "modelopt", 40, tmp_path / "m")
    assert args[1:] == ["-m", "benchmarks.peers.modelopt_peer", "384", "40", str(tmp_path / "m" / "export"),
                        str(tmp_path / "m" / "work")] and env == {"SEED": "3", "TTT": "5"}
    c.peer_defaults_env = {"TTT": "3"}
    _, env = peer.peer_command(c, "peer_defaults", 480, tmp_path / "f")
    assert env["EXTRA"] == c.peer_defaults_extra and "--optimizer muon" in env["EXTRA"] and env["TTT"] == "3"
    c.peer_extra = "--hidden-states-dtype float32"  # both arms
    assert peer.peer_command(c, "peer_matched", 480, tmp_path / "f")[1]["EXTRA"] == c.peer_extra
    assert peer.peer_command(c, "peer_defaults", 480, tmp_path / "f")[1]["EXTRA"].endswith(" " + c.peer_extra)


def test_each_peer_run_has_its_own_work_folder_over_the_shared_rows(tmp_path):
    c = cfg(tmp_path)
    c.peer_dir = str(tmp_path / "peer")
    works = {peer.peer_command(c, arm, 120, peer.run_dir(c, arm, 120))[0][-1] for arm in peer.PEER_ARMS}
    assert len(works) == 2  # the runner wipes WORK/ckpt: two at once must not share one
    for arm in peer.PEER_ARMS:
        folder = peer.run_dir(c, arm, 120)
        peer.link_peer_data(c, folder)
        assert (folder / "work" / "data").resolve() == tmp_path / "peer" / "work-384" / "data"


def test_run_dirs_differ_per_arm_budget_and_threads(tmp_path):
    c = cfg(tmp_path)
    dirs = {peer.run_dir(c, a, s) for a in peer.ARMS for s in (120, 480)}
    c.threads = 2
    dirs |= {peer.run_dir(c, "ours", 120)}
    assert len(dirs) == 2 * len(peer.ARMS) + 1


def test_serving_at_other_threads_reads_the_arms_trained_at_trained_threads(tmp_path):
    one = peer.run_dir(cfg(tmp_path), "ours_cached", 120)
    assert peer.run_dir(cfg(tmp_path, threads=2, train=False, trained_threads=1), "ours_cached", 120) == one
    assert peer.run_dir(cfg(tmp_path, threads=1, train=False, trained_threads=2), "ours_cached", 120) != one
    with pytest.raises(UserError, match="trained_threads"):
        cfg(tmp_path, threads=2, trained_threads=1)  # train=true would train at 2 into the 1-thread folder


def test_done_arms_are_reused(tmp_path, monkeypatch):
    c = cfg(tmp_path)
    folder = peer.run_dir(c, "peer_matched", 120)
    (folder / "export").mkdir(parents=True)
    (folder / "export" / "config.json").write_text("{}")
    monkeypatch.setattr(peer, "run_logged", lambda *a, **k: pytest.fail("a finished arm was trained again"))
    assert peer.train_arm(c, "peer_matched", 120) == folder


def test_ours_step_seconds_from_progress_lines():
    def lines(steps, per_step, pause_at=None, start=0):
        out, elapsed = [], 0.0
        for i in range(start + 1, start + steps + 1):
            elapsed += per_step + (30.0 if i == pause_at else 0.0)
            out.append(f"step {i}/200  train/loss 1.2345  {elapsed / (i - start):.2f} s/step  3 min left")
        return out

    log = "\n".join(["### cmd", *lines(41, 2.0, pause_at=15), "### resume", *lines(21, 3.0, start=100)])
    windows = timed_runs.ours_step_seconds(log)
    assert len(windows) == 4 + 2
    assert sorted(round(w, 1) for w in windows) == [2.0, 2.0, 2.0, 3.0, 3.0, 5.0]  # the pause lands in one window


def test_peer_record_reads_the_runner_log(tmp_path):
    folder = tmp_path / "peer_matched" / "n384_s120_seed0"
    folder.mkdir(parents=True)
    (folder / "train.log").write_text(
        "hidden states: 340 rows, 120000 tokens in 400.0 s (300 tokens/s)\n"
        "[train_cpu] 120 steps; seconds/step: first 14.00, mean of the rest 10.40; tokens/step (packed, prompts "
        "included): 1820; process 1300.0 s\n== seconds: rows 20, hidden states 402, training 1310 (OMP_NUM_THREADS=1)\n")
    (folder / "train.time").write_text("\tUser time (seconds): 1500.5\n\tSystem time (seconds): 10.5\n"
                                       "\tElapsed (wall clock) time (h:mm:ss or m:ss): 28:10.50\n"
                                       "\tMaximum resident set size (kbytes): 3145728\n")
    rec = records.peer_record(folder)
    assert rec["steps"] == 120 and rec["tokens_per_step"] == 1820 and rec["step_s_median"] == 10.4
    assert rec["hidden_states_tokens_per_s"] == 300 and rec["stage_seconds"]["hidden_states"] == 402
    assert rec["peak_rss_gib"] == 3.0 and rec["cpu_s"] == 1511.0 and rec["wall_s"] == 1690.5


def test_safetensors_tokens_reads_the_header(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"hidden_states": torch.zeros(7, 4, 3, dtype=torch.bfloat16), "token_ids": torch.zeros(7, dtype=torch.long)},
              str(tmp_path / "hs_0.safetensors"))
    assert records.safetensors_tokens(tmp_path / "hs_0.safetensors") == 7


def synthetic_rows():
    recs = []
    for arm, step_s, tps, taus in (("ours", 6.0, 1500.0, (1.20, 1.30)), ("peer_matched", 10.0, 1820.0, (1.18, 1.27)),
                                   ("peer_defaults", 10.5, 1820.0, (1.15, None))):
        for steps, tau in zip((120, 480), taus):
            recs.append({"name": f"{arm}@{steps}", "arm": arm, "steps": steps, "tokens_per_step": tps,
                         "step_s_median": step_s * 2, "cpu_s_per_step": step_s, "peak_rss_gib": 3.0, "cpu_s": 700.0})
    served = {"drafters": {r["name"]: {"tau": t, "speedup": 0.9, "outputs_match_target_only": True,
                                       "over_prompts": {"mean": t, "sd": 0.2, "se": 0.04},
                                       "by_set": {"mtbench_turn1": {"pooled": t}, "sharegpt": {"pooled": t}},
                                       "tau_per_prompt": [t, t + 0.1]}
                           for r, t in zip(recs, (1.20, 1.30, 1.18, 1.27, 1.15, None)) if t is not None}}
    return peer.rows_of(recs, served)


def test_table_plot_and_time_to_tau_from_synthetic_results(tmp_path):
    rows = synthetic_rows()
    ours = next(r for r in rows if r["name"] == "ours@120")
    assert ours["tokens_trained"] == 120 * 1500 and ours["train_tokens_per_cpu_s"] == 250 and ours["train_tokens_per_s"] == 125
    goal = peer.time_to_tau(rows, None, {"peer_matched": 400.0, "peer_defaults": 400.0})
    assert goal["goal"] == pytest.approx(1.15)  # the highest tau every arm reached
    assert goal["ours"] == {"steps": 120, "seconds": 720} and goal["peer_matched"]["seconds"] == 1600
    assert peer.time_to_tau(rows, 1.29, {})["peer_matched"] is None
    md = peer.markdown(rows, {"time to tau": goal})
    assert md.count("\n| ") == len(rows) and "| ours@120 | 120 | 180,000 | 1.200 ± 0.20 (0.040) |" in md
    assert "| peer_defaults@480 | 480 |" in md and "time to tau" in md
    peer.plot(rows, tmp_path / "peer.png")
    assert (tmp_path / "peer.png").stat().st_size > 1000


def test_speed_ratios_per_cpu_and_wall_second_at_each_budget():
    rows = synthetic_rows()
    per_cpu = peer.speed_ratios(rows, "train_tokens_per_cpu_s", [120, 480])
    assert per_cpu["ours/peer_matched@120"] == pytest.approx((1500 / 6.0) / (1820 / 10.0))
    assert per_cpu["ours/peer_defaults@480"] == pytest.approx((1500 / 6.0) / (1820 / 10.5))
    per_wall = peer.speed_ratios(rows, "train_tokens_per_s", [120])
    assert list(per_wall) == ["ours/peer_matched@120", "ours/peer_defaults@120"]  # only the budgets asked for
    assert per_wall["ours/peer_matched@120"] == pytest.approx((1500 / 12.0) / (1820 / 20.0))


def test_paired_difference_and_spread():
    d = peer.paired([1.5, 1.7, 1.6], [1.4, 1.5, 1.6])
    assert d["mean"] == pytest.approx(0.1) and d["n"] == 3 and d["se"] > 0
    assert json.dumps(peer.spread([1.0]))  # one prompt: no spread, still writable


def test_cpu_step_seconds_from_a_trace(tmp_path):
    trace = tmp_path / "train.cpu.tsv"
    samples = [(0, 1.0, "None"), (2, 3.0, "None")]  # loading: no step logged yet
    cpu = 3.0
    for i, step in enumerate(range(1, 32)):
        cpu += 2.0
        samples.append((4 + 2 * i, cpu, str(step)))
        if step == 15:
            samples.append((5 + 2 * i, cpu, str(step)))  # a stopped process: time passes, CPU does not
    trace.write_text("".join(f"{t}\t{c}\t{s}\n" for t, c, s in samples))
    assert timed_runs.cpu_step_seconds(trace) == [2.0, 2.0, 2.0]
    # resumed: a new process appends its samples, its CPU counting from 0; no window spans the two
    resumed = "".join(f"{100 + s}\t{3.0 * (s - 31)}\t{s}\n" for s in range(32, 53))
    trace.write_text("### first\n" + trace.read_text() + "### resumed\n" + resumed)
    assert timed_runs.cpu_step_seconds(trace) == [2.0, 2.0, 2.0, 3.0, 3.0]
    assert timed_runs.cpu_step_seconds(tmp_path / "absent.tsv") == []


def test_tree_cpu_seconds_of_this_process():
    assert timed_runs.tree_cpu_seconds(os.getpid()) > 0
    assert timed_runs.tree_cpu_seconds(2**22 + 7) == 0  # no such process


def test_step_patterns_match_both_trainers_lines(tmp_path):
    log = tmp_path / "train.log"
    log.write_bytes(b"step 7/120  train/loss 1.0  9.10 s/step  3 min left\n")
    assert timed_runs.last_step(log, timed_runs.STEP_LINES["ours"]) == 7
    log.write_bytes(b"                    profile/step_ms=1.04e+04,               \n"
                    b"                    profile/tokens_per_s=64.275,            \n"
                    b"                    epoch=0, lr=0.00e+00, global_step=11     \n"
                    b"                    profile/step_ms=950.5,                  \n")
    assert timed_runs.last_step(log, timed_runs.STEP_LINES["peer"]) == 11
    assert records.peer_step_seconds(log.read_text()) == [10.4, 0.9505]


def test_served_results_are_kept_per_drafter(tmp_path, monkeypatch):
    c = cfg(tmp_path)
    folders = {f"{a}@120": peer.run_dir(c, a, 120) for a in ("ours", "peer_matched")}
    calls = []

    def fake_serve(cfg_, drafters):
        calls.append(sorted(drafters))
        return {"prompts": [{"set": "mtbench", "turn": 1, "tokens": 10}], "target_only_tokens_per_s": 20.0,
                "drafters": {n: {"path": str(p), "tau": 1.2, "tau_per_prompt": [1.2]} for n, p in drafters.items()}}

    monkeypatch.setattr(peer, "serve", fake_serve)
    served = peer.served_results(c, {"ours@120": folders["ours@120"]}, tmp_path / "out")
    assert calls == [["ours@120"]] and served["drafters"]["ours@120"]["tau"] == 1.2
    served = peer.served_results(c, folders, tmp_path / "out")  # only the new drafter is served
    assert calls == [["ours@120"], ["peer_matched@120"]] and set(served["drafters"]) == set(folders)
    c.serve = False
    assert peer.served_results(c, folders, tmp_path / "out") is None
