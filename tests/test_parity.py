"""`python -m benchmarks.parity`: an export served from disk accepts what training measured, or the
check fails and names the likely cause (another target, a flipped norm_before_residual flag)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import parity
from common.config import UserError
from inference import evalsets, report
from inference.engine import generate
from speculators import export

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run_dir(llama_target, make_drafter, text_batch, tmp_path_factory):
    """A run directory as training leaves it: export/ and acceptance/report.json of the in-memory drafter,
    which is fitted to the target's greedy continuations so that it is accepted in part."""
    prompts = [text_batch[0, :12].tolist(), text_batch[1, 7:22].tolist()]
    continuations = [generate(llama_target, None, p, 30, k=0).tokens for p in prompts]
    length = min(len(p) + len(c) for p, c in zip(prompts, continuations))
    ids = torch.tensor([(p + c)[:length] for p, c in zip(prompts, continuations)])
    drafter = make_drafter(llama_target, depth=3, draft_vocab_size=llama_target.vocab_size)
    out = llama_target(ids)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(120):
        loss, _ = drafter.training_loss(out, ids, torch.ones_like(ids))
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.eval()
    root = tmp_path_factory.mktemp("run")
    export.save(drafter, root / "export", export.Verifier.of(llama_target))
    texts = [llama_target.tokenizer.decode(p) for p in prompts]
    cfg = report.InferenceConfig(drafter=str(root / "export"), max_new_tokens=30, k=3)
    result = report.measure(llama_target, drafter, evalsets.prompts_of([[t] for t in texts], None, llama_target, 30),
                            cfg)
    assert result["acceptance_length"] > 1.5  # the checks below need a drafter that is accepted
    report.write(result, root / "acceptance")
    return root


def test_the_export_matches_training(run_dir):
    result = parity.check(str(run_dir / "export"))
    assert result["served_tau"] == pytest.approx(result["reference_tau"], rel=parity.TOLERANCE)


def test_a_flipped_norm_before_residual_is_named(run_dir, tmp_path):
    flipped = tmp_path / "export"
    flipped.mkdir()
    for name in ("model.safetensors", "config.json"):
        (flipped / name).write_bytes((run_dir / "export" / name).read_bytes())
    config = json.loads((flipped / "config.json").read_text())
    config["norm_before_residual"] = not config["norm_before_residual"]
    (flipped / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="likely cause: norm_before_residual is True in the export"):
        parity.check(str(flipped), str(run_dir / "acceptance" / "report.json"))


def test_another_target_is_named(run_dir, qwen3_dir):
    with pytest.raises(UserError, match=f"likely cause: served with target {qwen3_dir}"):
        parity.check(str(run_dir / "export"), target_path=str(qwen3_dir))


def test_cli(run_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
    ok = subprocess.run([sys.executable, "-m", "benchmarks.parity", f"drafter={run_dir / 'export'}"], cwd=tmp_path,
                        env=env, capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0 and ok.stdout.splitlines()[-1].startswith("parity: served tau"), ok.stderr[-2000:]
    missing = subprocess.run([sys.executable, "-m", "benchmarks.parity", f"drafter={run_dir / 'export'}",
                              f"reference={tmp_path / 'none.json'}"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=600)
    assert missing.returncode != 0 and "no reference report" in missing.stderr.splitlines()[-1]
    assert not any(tmp_path.iterdir())  # the check writes nothing
