"""Every Hydra command a user runs answers a misspelt key and a missing value in one line that names the key.

Both fail in Hydra's composition or before the task starts, so no command here loads a model.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# folder: its import name (results/ holds lab scripts, not commands)
USER_FOLDERS = {"inference": "inference", "train": "train", "benchmarks": "benchmarks", "speculators": "speculators",
                "kernels": "forge_kernels"}

# command: (a misspelt override, the key it meant, the mandatory key a bare command lacks, or None).
COMMANDS = {
    "train.py": ("trainer.max_stepz=3", "trainer.max_steps", None),
    "inference": ("max_new_tokenz=3", "max_new_tokens", "drafter"),
    "train.hidden_cache": ("data.cache_dirr=x", "data.cache_dir", None),
    "train.regenerate": ("splitt=train", "split", "out"),
    "benchmarks.batch_sweep": ("repeatz=2", "repeats", None),
    "benchmarks.bench": ("max_new_tokenz=3", "max_new_tokens", "drafter"),
    "benchmarks.chat_target_card": ("conversationz=3", "conversations", "out"),
    "benchmarks.curve": ("titel=x", "title", "runs"),
    "benchmarks.compare": ("max_new_tokenz=3", "max_new_tokens", None),
    "benchmarks.device_check": ("stepz=3", "steps", None),
    "benchmarks.drafter_card": ("num_promptz=3", "num_prompts", "drafter"),
    "benchmarks.drafter_quant": ("schemez=[int8]", "schemes", "drafter"),
    "benchmarks.engines": ("max_new_tokenz=3", "max_new_tokens", "drafter"),
    "benchmarks.llamacpp_bench": ("max_new_tokenz=3", "max_new_tokens", "drafter"),
    "benchmarks.memory_plan": ("seq_lenn=64", "seq_len", "target"),
    "benchmarks.parity": ("referencee=x", "reference", "drafter"),
    "benchmarks.peer": ("stepz=3", "steps", None),
    "benchmarks.peers.dspark_bench": ("stepz=3", "steps", None),
    "benchmarks.planning": ("max_new_tokenz=3", "max_new_tokens", None),
    "benchmarks.quant_bench": ("repeatz=2", "repeats", "out"),
    "benchmarks.quant_report": ("group_sizee=32", "group_size", "drafter"),
    "benchmarks.support_table": ("sourc=x.json", "source", None),
    "benchmarks.target_card": ("sampels=2", "samples", "model_dir"),
    "benchmarks.regen_engines": ("max_new_tokenz=3", "max_new_tokens", None),
    "forge_kernels.bench_loss": ("repeatz=2", "repeats", "out"),
    "forge_kernels.bench_quant_matmul": ("repeatz=2", "repeats", "out"),
    "speculators.export": ("formatt=gguf", "format", "source"),
}
# A mandatory key only some choices bring: conf/eval/file.yaml's path.
CHOICE_MISSING = {"train.py": (["eval=file"], "eval.path"), "train.hidden_cache": (["eval=file"], "eval.path")}


def hydra_commands() -> set[str]:
    """`train.py` and each module under USER_FOLDERS that runs a Hydra main."""
    found = {"train.py"}
    for folder, package in USER_FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            if re.search(r"^@hydra\.main|^\s+run_command\(", path.read_text(), re.M):
                module = path.relative_to(REPO / folder).with_suffix("")
                found.add(".".join((package, *(module.parts[:-1] if module.name == "__main__" else module.parts))))
    return found


def run(command: str, *overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
    for name in ("HYDRA_FULL_ERROR", "SPECULATORS_TRACEBACK"):
        env.pop(name, None)
    argv = [str(REPO / command)] if command.endswith(".py") else ["-m", command]
    return subprocess.run([sys.executable, *argv, *overrides, f"hydra.run.dir={cwd / 'run'}"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The one line a refused command prints; it exits 1, the code of sys.exit(message)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, (result.returncode, result.stderr[-3000:])
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


def test_every_hydra_command_is_covered():
    assert hydra_commands() == set(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_misspelt_key_names_the_nearest_keys(command, tmp_path):
    typo, meant, _ = COMMANDS[command]
    line = one_line_error(run(command, typo, cwd=tmp_path))
    assert f"'{typo.split('=')[0]}'" in line and f"'{meant}'" in line, line
    assert "+" not in line, line  # no advice to append the key


@pytest.mark.parametrize("command", sorted(c for c, (_, _, key) in COMMANDS.items() if key) + sorted(CHOICE_MISSING))
def test_missing_value_names_the_key(command, tmp_path):
    overrides, key = CHOICE_MISSING.get(command) or ([], COMMANDS[command][2])
    line = one_line_error(run(command, *overrides, cwd=tmp_path))
    assert re.search(rf"\b{re.escape(key)}=<[^>]+>.* required", line), line
