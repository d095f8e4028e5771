"""A run directory is a run's identity (train/run.py):

- a new run into a folder that holds a checkpoint or an export is refused in one line, before the target
  loads, unless overwrite=true (which starts it over);
- `resume=` with a setting that changes what training computes is refused, naming the keys and both
  values; the settings a user may mean to change (more steps, logging, checkpoint frequency, serving,
  threads, the split of the same global batch) are applied and said;
- SIGTERM or Ctrl-C after training, during the export or its closing report, end in one line; the run
  directory says UNFINISHED, and `resume=` finishes the export and the report without training again.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_config import composed, typed
from test_reliability import (
    REPO,
    cli_env,
    copy_small_stdlib,
    folder_bytes,
    one_line_error,
    run_in_process,
    tiny_training,
)

from common.config import UserError
from train.callbacks import CheckpointOnSignal
from train.run import compare_settings, save_settings
from train.trainer import UNFINISHED


@pytest.fixture(scope="module")
def small_stdlib(tmp_path_factory):
    return copy_small_stdlib(tmp_path_factory.mktemp("stdlib"))


@pytest.fixture
def interactive_sigint():
    """Ctrl-C as in a terminal (CI runs us in the background, where SIGINT is ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def step_of(run_dir) -> int:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]


def no_target_load(monkeypatch):
    from train.distill import FrozenTarget

    def fail(*_, **__):
        raise AssertionError("the target was loaded before the refusal")

    monkeypatch.setattr(FrozenTarget, "load", fail)


def stopped_at_step_1(args, monkeypatch):
    """The run of `args` stopped by SIGTERM after its first step, with its checkpoint."""

    def sigterm_after_step_1(self, trainer, *_):
        if trainer.global_step == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    with monkeypatch.context() as patch:
        patch.setattr(CheckpointOnSignal, "on_train_batch_end", sigterm_after_step_1, raising=False)
        code, stderr = run_in_process("train", args, monkeypatch)
    assert code == 1 and "stopped by a signal at step 1" in stderr, stderr


def test_a_new_run_into_a_run_folder_is_refused_unless_overwrite(llama_dir, small_stdlib, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    args = tiny_training(llama_dir, small_stdlib, run_dir)
    stopped_at_step_1(args, monkeypatch)
    checkpoint = (run_dir / "checkpoints" / "last.ckpt").read_bytes()

    with monkeypatch.context() as patch:  # the same command again, fewer steps: it would have replaced step 1
        no_target_load(patch)
        code, stderr = run_in_process("train", args + ["trainer.max_steps=1"], monkeypatch)
    line = one_line_error(code, stderr)
    assert f"resume={run_dir}" in line and "overwrite=true" in line and "checkpoints/last.ckpt" in line, line
    assert (run_dir / "checkpoints" / "last.ckpt").read_bytes() == checkpoint

    with monkeypatch.context() as patch:  # started over, it fails before its first checkpoint: none of the old left
        no_target_load(patch)
        with pytest.raises(AssertionError, match="the target was loaded"):
            run_in_process("train", args + ["overwrite=true"], monkeypatch)
    assert not (run_dir / "checkpoints" / "last.ckpt").exists()

    code, stderr = run_in_process("train", args + ["overwrite=true"], monkeypatch)  # starts it over, to the end
    assert code == 0, stderr
    assert step_of(run_dir) == 2 and json.loads((run_dir / "export" / "training.json").read_text())["steps"] == 2
    assert not (run_dir / UNFINISHED).exists()

    with monkeypatch.context() as patch:  # a finished run is refused the same way
        no_target_load(patch)
        code, stderr = run_in_process("train", args, monkeypatch)
    assert "holds a finished run (checkpoints/last.ckpt, export); pass overwrite=true" in one_line_error(code, stderr)


def test_resume_refuses_a_changed_setting_and_applies_a_changeable_one(llama_dir, small_stdlib, tmp_path,
                                                                       monkeypatch):
    run_dir = tmp_path / "run"
    args = tiny_training(llama_dir, small_stdlib, run_dir)
    stopped_at_step_1(args, monkeypatch)
    resume = args + [f"resume={run_dir}"]

    for changed, expected in [(["optim.lr=0.5", "data.seq_len=16"],
                               ["data.seq_len 32 -> 16", "optim.lr 0.001 -> 0.5"]),
                              (["drafter.depth=3"], ["drafter.depth 2 -> 3"]),
                              (["data.batch_size=4"], ["data.batch_size 2 -> 4"]),  # a larger global batch
                              (["data.include_tests=true"], ["data.include_tests False -> True"])]:
        with monkeypatch.context() as patch:
            no_target_load(patch)
            code, stderr = run_in_process("train", resume + changed, monkeypatch)
        line = one_line_error(code, stderr)
        assert all(e in line for e in expected), (changed, line)
    assert step_of(run_dir) == 1

    # The same global batch split otherwise, more steps, other logging: applied, said, and trained.
    code, stderr = run_in_process("train", resume + [
        "data.batch_size=1", "trainer.accumulate_grad_batches=2", "trainer.max_steps=3", "trainer.log_every_n_steps=1",
        "trainer.val_every_n_steps=3", "trainer.checkpoint_every_n_steps=3"], monkeypatch)
    assert code == 0, stderr
    assert step_of(run_dir) == 3
    saved = json.loads((run_dir / "run.json").read_text())  # what a further resume compares with
    assert saved["trainer.max_steps"] == 3 and saved["data.batch_size"] == 1


def test_resume_names_the_applied_changes_in_one_line(llama_dir, small_stdlib, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    args = tiny_training(llama_dir, small_stdlib, run_dir)
    stopped_at_step_1(args, monkeypatch)
    capsys.readouterr()
    code, stderr = run_in_process("train", args + [f"resume={run_dir}", "trainer.max_steps=3",
                                                   "serve_eval.num_prompts=1"], monkeypatch)
    assert code == 0, stderr
    applied = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resume=")]
    assert applied == [f"resume={run_dir}: applied serve_eval.num_prompts 2 -> 1, trainer.max_steps 2 -> 3 "
                       f"(the learning rate's cosine now ends at step 3)"], applied


def test_resume_on_another_number_of_processes_keeps_the_global_batch(tmp_path, capsys):
    """2 processes of 4 rows continue as 1 of 8 (tests/test_ddp.py measures the losses and weights); 1 of 2 is
    another global batch."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").touch()
    two, _ = typed(composed(["conf=eagle3_pycode", "trainer=ddp", "data.batch_size=4"]))
    save_settings(run_dir, two)
    one, _ = typed(composed(["conf=eagle3_pycode", "data.batch_size=8", f"resume={run_dir}"]))
    compare_settings(one)
    assert capsys.readouterr().out.strip() == (
        f"resume={run_dir}: applied data.batch_size 4 -> 8, trainer.devices 2 -> 1, trainer.strategy 'ddp' -> 'auto' "
        "(the same 8 sequences per step; the same rows in each step, split among the processes; its loss the mean "
        "of theirs, equal to one process's where each holds as many loss tokens)")
    fewer, _ = typed(composed(["conf=eagle3_pycode", "data.batch_size=2", f"resume={run_dir}"]))
    with pytest.raises(UserError, match="computes: data.batch_size 4 -> 2, trainer.devices 2 -> 1; pass them"):
        compare_settings(fewer)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_in_the_closing_report_leaves_it_to_resume(llama_dir, small_stdlib, tmp_path, monkeypatch, signum,
                                                           interactive_sigint):
    import train.distill

    run_dir = tmp_path / "run"
    args = tiny_training(llama_dir, small_stdlib, run_dir)
    real_report = train.distill.acceptance_report

    def signalled_report(*a, **kw):
        os.kill(os.getpid(), signum)  # delivered at the next bytecode, inside the report
        return real_report(*a, **kw)

    with monkeypatch.context() as patch:
        patch.setattr(train.distill, "acceptance_report", signalled_report)
        code, stderr = run_in_process("train", args, monkeypatch)
    assert code == 1 and "Traceback" not in stderr, stderr
    line = stderr.rstrip().splitlines()[-1]
    assert line.startswith(f"stopped by {signal.Signals(signum).name} after training") and f"resume={run_dir}" in line
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C behaves as usual again
    assert (run_dir / UNFINISHED).exists() and not (run_dir / "acceptance").exists()
    exported = folder_bytes(run_dir / "export")

    with monkeypatch.context() as patch:  # a new run would replace it; only resume= finishes it
        no_target_load(patch)
        code, stderr = run_in_process("train", args, monkeypatch)
    assert f"resume={run_dir}" in one_line_error(code, stderr)

    code, stderr = run_in_process("train", args + [f"resume={run_dir}"], monkeypatch)
    assert code == 0, stderr
    assert not (run_dir / UNFINISHED).exists()
    report = json.loads((run_dir / "acceptance" / "report.json").read_text())
    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == report["config"]["k"]
    assert step_of(run_dir) == 2  # trained no further: the same weights, exported again
    assert folder_bytes(run_dir / "export")["model.safetensors"] == exported["model.safetensors"]

    with monkeypatch.context() as patch:  # now finished: resume= refuses it as before
        no_target_load(patch)
        code, stderr = run_in_process("train", args + [f"resume={run_dir}"], monkeypatch)
    assert "overwrite=true" in one_line_error(code, stderr)


def test_sigterm_to_train_py_in_its_closing_report(llama_dir, small_stdlib, tmp_path):
    """As a scheduler does it: SIGTERM to `python train.py` once its export is there (its report is running)."""
    run_dir = tmp_path / "run"
    args = [str(REPO / "train.py"), *tiny_training(llama_dir, small_stdlib, run_dir)]
    run = subprocess.Popen([sys.executable, *args], cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    while not (run_dir / "export").exists() and run.poll() is None:
        time.sleep(0.02)
    run.send_signal(signal.SIGTERM)
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.rstrip().splitlines()[-1] == (f"stopped by SIGTERM after training, before export/ and its closing "
                                                f"report were finished; finish them with resume={run_dir}")
    assert (run_dir / UNFINISHED).exists() and not (run_dir / "acceptance").exists()

    resumed = subprocess.run([sys.executable, *args, f"resume={run_dir}"], cwd=tmp_path, env=cli_env(),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = json.loads((run_dir / "acceptance" / "report.json").read_text())
    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == report["config"]["k"]
    assert not (run_dir / UNFINISHED).exists()
