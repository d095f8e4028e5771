"""benchmarks.device_check. Without a GPU it says so in one line and measures nothing; its training
loop, which the GPU run times, trains the conftest tiny Llama here on the CPU; a section that fails is recorded,
not raised."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import LAYER_IDS
from test_cli import REPO

from benchmarks import device_check

SEQ_LEN, BATCH = 32, 2


def test_without_a_gpu_it_says_so_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "device_check.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}  # no GPU, even on a machine with one
    env.pop("HYDRA_FULL_ERROR", None)
    child = subprocess.run([sys.executable, "-m", "benchmarks.device_check", f"out={out}", "steps=2"], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 1 and child.stdout == ""
    lines = child.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("no GPU: ") and "nothing was measured" in lines[0], child.stderr
    assert "Traceback" not in child.stderr and not out.exists()


@pytest.mark.parametrize("recipe, family_overrides", [
    ("eagle3_pycode", ["drafter.depth=2"]), ("dspark_pycode", ["drafter.num_layers=2", "drafter.markov_rank=8"])])
def test_the_training_loop_it_times_trains_on_the_cpu(recipe, family_overrides, llama_dir, tmp_path):
    docs = tmp_path / "docs.jsonl"
    text = (REPO / "train" / "data.py").read_text()
    docs.write_text("".join(json.dumps({"text": part}) + "\n" for part in text.split("\n\n") if part.strip()))
    recipe = device_check.compose_recipe(recipe, [
        "data=text", f"data.path={docs}", f"data.seq_len={SEQ_LEN}", f"data.batch_size={BATCH}", "logger=none",
        f"target.name_or_path={llama_dir}", "target.layer_ids=[" + ",".join(map(str, LAYER_IDS)) + "]",
        "drafter.draft_vocab_size=96", "trainer.precision=32-true", *family_overrides])
    result = device_check.train_steps(recipe, torch.device("cpu"), steps=2, warmup_steps=1)
    assert len(result["losses"]) == 3 and all(math.isfinite(loss) for loss in result["losses"])
    assert result["tokens_per_s"] == BATCH * SEQ_LEN / result["step_s"] > 0
    memory = result["memory"]
    assert 0 < memory["resident_before_steps_gib"] <= memory["peak_gib"]
    assert 0 < result["trained_fraction_max"] <= 1 and result["target_weight_bytes"] > 0


def test_a_failing_section_is_recorded_and_the_others_run():
    failed = device_check.section("broken", lambda: {"value": 1 / 0})
    assert failed == {"ok": False, "error": "ZeroDivisionError: division by zero"}
    assert device_check.section("fine", lambda: {"value": 1}) == {"ok": True, "value": 1}
