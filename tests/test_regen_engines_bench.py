"""benchmarks.regen_engines: its config, and its tables, agreement, resume verdict and quiet machine on fake
records (no engine runs here)."""

import dataclasses
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_config import CONF, composed

from benchmarks.regen_engines import (
    RegenEnginesConfig,
    identical_replies,
    markdown,
    quiet,
    regenerate_args,
    speed_record,
    tables,
    verdict,
)
from common.config import UserError, to_dataclass


def test_the_config_file_mirrors_the_dataclass():
    cfg = composed([], CONF / "benchmarks", "regen_engines")
    assert set(cfg) - {"hydra"} == {f.name for f in dataclasses.fields(RegenEnginesConfig)}
    assert to_dataclass(RegenEnginesConfig, cfg) == RegenEnginesConfig()
    with pytest.raises(UserError, match="engines='sglang' is not valid"):
        RegenEnginesConfig(resume_engines=["sglang"])


def test_each_engine_regenerates_the_same_rows():
    cfg = RegenEnginesConfig(vllm_python="/v/bin/python")
    runs = {e: regenerate_args(cfg, e, Path("/w") / e, 8, 1000) for e in ("transformers", "vllm")}
    assert runs["vllm"][-1] == "vllm_python=/v/bin/python" and "engine=vllm" in runs["vllm"]
    same = {"target=smollm2", "data=sharegpt", "split=train", "limit=32", "max_replies=1", "max_new_tokens=128",
            "batch_size=8", "threads=1"}
    assert all(same <= set(args) for args in runs.values())


def rows(texts: list[str], first: int = 0) -> list[dict]:
    """Conversations answered with `texts`, each after a greeting of the data set's own (not a reply)."""
    return [{"id": f"c{first + i}", "messages": [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "q"},
                                                 {"role": "assistant", "content": t}]}
            for i, t in enumerate(texts)]


def record(texts: list[str], tokens: int = 100, seconds: float = 4.0) -> dict:
    meta = {"engine": "an engine 1.0", "totals": {"replies": len(texts), "tokens": tokens, "cut": 1, "seconds": seconds}}
    return speed_record(meta, 10.0, rows(texts))


def test_speed_and_identical_replies():
    engines = {"transformers": record(["a", "b", "c"]), "llamacpp": record(["a", "x", "y"]),
               "vllm": record(["a", "b", "c"], tokens=300, seconds=2.0), "broken": {"error": "exit 1: no server"}}
    assert engines["vllm"]["tokens_per_second"] == 150 and engines["vllm"]["tokens_per_second_with_loading"] == 30
    assert identical_replies(engines) == {"transformers = llamacpp": {"identical": 1, "of": 3},
                                          "transformers = vllm": {"identical": 3, "of": 3},
                                          "llamacpp = vllm": {"identical": 1, "of": 3}}


def test_resume_verdict_counts_lost_and_repeated_conversations():
    whole = rows(["a", "b", "c", "d"])
    assert verdict(whole, rows(["a", "b", "c", "d"])) == {"conversations": 4, "expected": 4, "lost": [], "repeated": [],
                                                         "equal": True}
    repeated = rows(["a", "b"]) + rows(["b", "c", "d"], first=1)
    assert verdict(whole, repeated) | {"equal": None} == {"conversations": 5, "expected": 4, "lost": [],
                                                          "repeated": ["c1"], "equal": None}
    assert verdict(whole, rows(["a", "b", "c"])) == {"conversations": 3, "expected": 4, "lost": ["c3"], "repeated": [],
                                                     "equal": False}
    assert not verdict(whole, rows(["a", "b", "c", "e"]))["equal"]  # all there, one reply differs


def test_tables_and_markdown():
    result = {"command": "python -m benchmarks.regen_engines", "date": "2026-12-01T00:00:00+00:00",
              "git_revision": "abc", "machine": {"cpu": "CPU", "cores": 2}, "note": "tests", "paused_pids": [7],
              "busy_processes": {"start": ["50.0% nice 0: pytest"], "end": []},
              "load_average": {"start": [1.0, 1.0, 1.0], "end": [2.0, 2.0, 2.0]},
              "config": dataclasses.asdict(RegenEnginesConfig()),
              "engines": {"transformers": record(["a", "b"]), "vllm": {"error": "exit 1: boom"}},
              "identical_replies": {"transformers = llamacpp": {"identical": 1, "of": 2}},
              "resume": {"vllm": {"resumed_from": 16, **verdict(rows(["a"]), rows(["a"])), "children": 1,
                                  "children_left": 0, "exit_code": -15, "error": None},
                         "llamacpp": {"error": "restart: exit 1"}}}
    text = tables(result)
    assert "| transformers | an engine 1.0 | 2 | 100 | 1 | 4.0 | 25.0 | 10.0 | 10.0 |" in text
    assert "| vllm | failed: exit 1: boom |" in text
    assert "| transformers = llamacpp | 1 of 2 |" in text
    assert "| vllm | 16 | 1 of 1 | 0 | 0 | yes | 0 of 1 |" in text
    assert "| llamacpp | failed: restart: exit 1 |" in text
    page = markdown(result)
    assert "paused while timing (SIGSTOP): 7; beside: tests; busy processes at the start: 50.0% nice 0: pytest" in page


def stopped(pid: int) -> bool:
    """Whether the process is stopped, once a signal sent to it has had time to arrive."""
    for _ in range(100):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return True
        time.sleep(0.01)
    return False


def test_quiet_holds_the_lock_and_pauses_the_listed_groups_whatever_happens(tmp_path):
    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)  # a group of its own, as a benchmark's
    try:
        lock, pids = tmp_path / "quiet.lock", tmp_path / "background.pids"
        pids.write_text(f"{sleeper.pid}\n999999999\n")  # one gone long ago
        with pytest.raises(RuntimeError), quiet(lock, pids) as paused:
            assert paused == [sleeper.pid] and lock.exists() and stopped(sleeper.pid)
            raise RuntimeError("a failing measurement")
        assert not lock.exists() and not stopped(sleeper.pid)
    finally:
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()
