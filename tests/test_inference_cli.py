"""`python -m inference`: report.json, acceptance.png and the table, and the same report in W&B (offline)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from speculators import export

REPO = Path(__file__).resolve().parent.parent


def test_report_files_and_an_offline_wandb_run(llama_dir, llama_target, make_drafter, tmp_path):
    drafter_dir = export.save(make_drafter(llama_target), tmp_path / "export", export.Verifier.of(llama_target))
    out = tmp_path / "report"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
    env.pop("WANDB_MODE", None)
    result = subprocess.run([sys.executable, "-m", "inference", f"drafter={drafter_dir}", "num_prompts=2",
                             "prompt_lines=2", "max_new_tokens=8", "num_speculative_tokens=2", f"out={out}",
                             "logger.kind=wandb", "logger.mode=offline", "logger.project=test"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["target"] == str(llama_dir)  # the verifier the export names
    assert len(report["acceptance_rate_per_position"]) == 2 and report["outputs_match_baseline"] is True
    assert (out / "acceptance.png").stat().st_size > 0
    assert f"report: {out / 'report.json'}" in result.stdout
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert json.loads((runs[0] / "files" / "report.json").read_text()) == report


def test_quant_serves_the_training_recipes_quantized_targets():
    from hydra import compose, initialize_config_dir

    from inference.report import InferenceConfig  # its module registers conf/quant/ as the quant group
    from speculators.config import to_dataclass
    from speculators.quant import QuantConfig

    with initialize_config_dir(str(REPO / "conf" / "inference"), version_base="1.3"):
        default = to_dataclass(InferenceConfig, compose("config", ["drafter=x"]))
        int4 = to_dataclass(InferenceConfig, compose("config", ["drafter=x", "quant=int4", "quant.group_size=64"]))
    assert default.quant == QuantConfig()
    assert int4.quant == QuantConfig(scheme="int4", group_size=64)
