"""`python train.py`: one real end-to-end run on a tiny target, and the one-line errors of bad command lines."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from conftest import LAYER_IDS, VOCAB_SIZE
from safetensors import safe_open

from speculators.target import FrozenTarget, TargetConfig

REPO = Path(__file__).resolve().parent.parent
DRAFT = 128


def run_train(args, cwd: Path, timeout: int):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "0"}
    env.pop("SPECULATORS_TRACEBACK", None)
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_train_eagle3_end_to_end(llama_dir, tmp_path):
    run_dir = tmp_path / "run"
    layer_ids = "[" + ",".join(map(str, LAYER_IDS)) + "]"
    args = [
        "conf=eagle3_pycode", "trainer.max_steps=3", "logger=none", f"hydra.run.dir={run_dir}",
        f"target.name_or_path={llama_dir}", f"target.layer_ids={layer_ids}", f"drafter.draft_vocab_size={DRAFT}",
        "drafter.depth=3", "data.seq_len=64", "data.batch_size=2", "data.max_val_sequences=2",
        "trainer.val_every_n_steps=3", "trainer.checkpoint_every_n_steps=3", "trainer.num_threads=1",
        "trainer.log_every_n_steps=2",  # the default progress_bar=true, but output goes to a pipe: lines, no bar
        "serve_eval.report_new_tokens=24",
    ]
    result = run_train(args, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^step 2/3  .*train/loss \d+\.\d{4}.*  \d+\.\d\d s/step  \d+ min left$", result.stdout, re.M)
    assert re.search(r"^validation at step 3: .*val/loss \d+\.\d{4}", result.stdout, re.M)

    export_dir = run_dir / "export"
    assert f"export: {export_dir}" in result.stdout
    config = json.loads((export_dir / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == DRAFT
    assert config["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(llama_dir)
    with safe_open(str(export_dir / "model.safetensors"), "pt") as f:
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert d2t.dtype == torch.int64 and d2t.shape == (DRAFT,)
    assert t2d.dtype == torch.bool and t2d.shape == (VOCAB_SIZE,)
    assert int(t2d.sum()) == DRAFT
    assert torch.equal(torch.arange(DRAFT) + d2t, torch.nonzero(t2d).flatten())

    training = json.loads((export_dir / "training.json").read_text())  # the budget comparisons state
    assert training["family"] == "eagle3" and training["steps"] == 3 and training["tokens_seen"] == 3 * 2 * 64
    assert 0 <= training["wall_time_s"] < 900
    first_wall_time = training["wall_time_s"]
    assert training["target_fingerprint"] == FrozenTarget.load(TargetConfig(str(llama_dir), layer_ids=LAYER_IDS)).fingerprint()

    report = json.loads((run_dir / "acceptance" / "report.json").read_text())
    sweep = report["k_sweep"]  # K = 1 to the depth, against target-only decoding; the fastest is the report's
    assert list(sweep) == ["1", "2", "3"] and report["config"]["k"] == int(max(sweep, key=lambda k: sweep[k]["speedup"]))
    k = report["config"]["k"]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == k  # what engines serve
    assert config["trained_depth"] == 3
    for curve, length in ((report["acceptance_rate_per_position"], k), (report["offline_accuracy_per_step"], 3)):
        assert len(curve) == length and all(0.0 <= a <= 1.0 for a in curve)
    assert report["outputs_match_baseline"] is True and report["config"]["max_new_tokens"] == 24
    lookup = report["lookup"]  # the shortest K behind n-gram lookup chains of up to serve_eval.lookup_tokens
    assert lookup["k"] == 1 and lookup["outputs_match_baseline"] is True and lookup["num_drafts"] > 0
    assert f"behind n-gram lookup (python -m inference drafter={export_dir} {lookup['command']})" in result.stdout
    assert (run_dir / "acceptance" / "acceptance.png").stat().st_size > 0

    # The checkpoint holds the drafter only, never the target's weights.
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 3
    assert ckpt["state_dict"] and all(k.startswith("drafter.") for k in ckpt["state_dict"])
    assert "drafter.embed_tokens.weight" not in ckpt["state_dict"]  # nor the target's embedding the drafter holds

    # init_from: a new run starts from the export's weights and draft vocabulary and counts its budget.
    common = [arg for arg in args if not arg.startswith(("hydra.run.dir", "trainer.max_steps", "trainer.val_every",
                                                          "trainer.checkpoint_every"))]
    continued = tmp_path / "continued"
    result = run_train([*common, f"init_from={export_dir}", "trainer.max_steps=1", "optim.lr=1e-12",
                        "optim.warmup_steps=0", f"hydra.run.dir={continued}"], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    training = json.loads((continued / "export" / "training.json").read_text())
    assert training["steps"] == 4 and training["tokens_seen"] == 4 * 2 * 64
    assert training["wall_time_s"] >= first_wall_time  # the continued export's time counted too
    assert training["init_from"] == {"path": str(export_dir), "steps": 3, "tokens_seen": 3 * 2 * 64}
    before = json.loads((continued / "acceptance" / "report.json").read_text())["init_from"]
    assert before["path"] == str(export_dir) and before["k"] == before["this_run"]["k"] == k  # compared at one K
    with safe_open(str(export_dir / "model.safetensors"), "pt") as first, \
            safe_open(str(continued / "export" / "model.safetensors"), "pt") as second:
        for name in ("d2t", "fc.weight", "lm_head.weight"):
            torch.testing.assert_close(second.get_tensor(name), first.get_tensor(name), rtol=0, atol=1e-6)

    other_vocab = run_train([*common, f"init_from={export_dir}", f"drafter.draft_vocab_size={DRAFT // 2}",
                             f"hydra.run.dir={tmp_path / 'refused'}"], cwd=tmp_path, timeout=900)
    assert "init_from=" in assert_one_line_error(other_vocab)


def assert_one_line_error(result):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines, "no error message on stderr"
    assert lines[-1].startswith("error:"), result.stderr
    return lines[-1]


def test_unknown_recipe_names_the_choices(tmp_path):
    result = run_train(["conf=nope", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=120)
    last = assert_one_line_error(result)
    assert "nope" in last and "eagle3" in last and "target_pretrain" in last


def test_unknown_key_names_the_allowed_keys(tmp_path):
    result = run_train(["+trainer.foo=1", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                       timeout=300)
    last = assert_one_line_error(result)
    assert "trainer.foo" in last and "max_steps" in last and "val_every_n_steps" in last
    assert not (tmp_path / "run" / "export").exists()


def test_bad_value_is_a_one_line_error(tmp_path):
    result = run_train(["trainer.max_steps=abc", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                       timeout=300)
    last = assert_one_line_error(result)
    assert "trainer.max_steps" in last and "abc" in last


def test_progress_bar_on_a_terminal_lines_otherwise(tmp_path, monkeypatch):
    from train.callbacks import ProgressLines
    from train.recipes import TrainerConfig
    from train.trainer import make_trainer

    def progress(progress_bar: bool, terminal: bool) -> tuple[bool, bool]:
        monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
        trainer = make_trainer(TrainerConfig(progress_bar=progress_bar), False, tmp_path)
        lines = any(isinstance(c, ProgressLines) for c in trainer.callbacks)
        return trainer.progress_bar_callback is not None, lines

    assert progress(True, terminal=True) == (True, False)
    assert progress(True, terminal=False) == (False, True)
    assert progress(False, terminal=True) == (False, True)
