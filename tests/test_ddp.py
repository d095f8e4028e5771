"""Multi-process training (trainer.strategy=ddp, fsdp): two CPU processes (gloo) train EAGLE-3 as one
process does with the same global batch: the same rows in every step, split disjointly between
the processes, the same loss curve, the same weights, and a checkpoint whose data position resumes anywhere.

A run resumes on another number of processes (2 by 1, 1 by 2) with the same rows, losses and weights.

Run as a script, this file is the 2-process run: `python tests/test_ddp.py <target dir> <out.json> <strategy>
[<run dir to resume>]` (Lightning's DDP launcher starts the second process with the same command line).
"""

import json
import os
import re
import string
import subprocess
import sys
import textwrap
from pathlib import Path

import datasets
import lightning as L
import pytest
import torch
from conftest import LAYER_IDS, VOCAB_SIZE
from test_cli import run_train
from test_config import composed, typed

from common.config import UserError
from speculators import draft_vocab, export
from speculators.eagle3 import Eagle3Config, Eagle3Drafter
from speculators.target import FrozenTarget, TargetConfig
from train.data import DataConfig, TextDataModule
from train.module import DrafterModule
from train.optim import OptimConfig
from train.recipes import TrainerConfig
from train.trainer import UNFINISHED, fit, make_trainer

SEQ_LEN = 32
GLOBAL_BATCH = 4
DDP_STEPS = 4
# Every target token in the draft vocab: each process's loss is then a mean over the same number
# of positions, so the mean of the two processes' gradients is the one-process gradient exactly.
DRAFT = VOCAB_SIZE
TOLERANCE = 1e-4  # relative, on each step's loss; measured differences are about 1e-7
WEIGHT_TOLERANCE = 1e-4  # absolute, on every weight after DDP_STEPS Adam steps of lr 1e-2; measured about 1e-5


class Record(L.Callback):
    """Each step's loss averaged over the processes, the rows every process trained on, and the drafter's whole
    weights after each step of `weights_at` (an FSDP shard gathered)."""

    def __init__(self, weights_at=(DDP_STEPS,)):
        self.losses, self.rows, self.backend, self.weights_held, self.weights = {}, {}, None, None, {}
        self.weights_at = weights_at

    def on_train_start(self, trainer, module):
        """The fraction of the drafter's weights this process holds: 1 under ddp, about 1/2 under fsdp."""
        from torch.distributed.tensor import DTensor

        params = list(module.drafter.parameters())
        held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
        self.weights_held = held / sum(p.numel() for p in params)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step, strategy = trainer.global_step, trainer.strategy
        self.losses[step] = float(strategy.reduce(outputs["loss"].detach(), reduce_op="mean"))
        self.rows[step] = strategy.all_gather(batch["input_ids"]).reshape(-1, SEQ_LEN).tolist()  # rank by rank
        if torch.distributed.is_initialized():
            self.backend = torch.distributed.get_backend()
        if step in self.weights_at:
            from torch.distributed.tensor import DTensor

            self.weights[step] = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                            for name, p in module.drafter.named_parameters()}


def corpus() -> datasets.DatasetDict:
    texts = [Path(m.__file__).read_text() for m in (json.decoder, json.encoder, textwrap, string)]
    split = {"path": [f"f{i}.py" for i in range(len(texts))], "text": texts}
    return datasets.DatasetDict({s: datasets.Dataset.from_dict(split) for s in ("train", "validation", "test")})


def train(target_dir: str, devices: int, max_steps: int, run_dir: Path, resume: str | None = None,
          strategy: str = "ddp", weights_at=(DDP_STEPS,)):
    L.seed_everything(0)
    target = FrozenTarget.load(TargetConfig(name_or_path=target_dir, layer_ids=LAYER_IDS))
    data_cfg = DataConfig(seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // devices, max_val_sequences=2)
    data = TextDataModule(data_cfg, corpus(), target.tokenizer, seed=0)
    data.setup("fit")
    counts = draft_vocab.count_tokens(data.train_rows, data.train_mask, target.vocab_size)
    drafter = Eagle3Drafter.from_target(Eagle3Config(depth=2, draft_vocab_size=DRAFT), target, counts)
    module = DrafterModule(drafter, target, OptimConfig(lr=1e-2, warmup_steps=2), max_steps=6)
    record = Record(weights_at)
    cfg = TrainerConfig(max_steps=max_steps, devices=devices, strategy=strategy if devices > 1 else "auto",
                        val_every_n_steps=1000, checkpoint_every_n_steps=DDP_STEPS, progress_bar=False)
    trainer = make_trainer(cfg, False, run_dir, [record])
    fit(trainer, module, data, resume)
    return record, trainer


def test_trainer_ddp_config_and_its_bad_values():
    recipe, _ = typed(composed(["conf=eagle3_pycode", "trainer=ddp"]))
    trainer = recipe.trainer
    assert (trainer.strategy, trainer.accelerator, trainer.devices, trainer.num_nodes) == ("ddp", "cpu", 2, 1)
    assert trainer.max_steps == 600  # the recipe's own settings still apply
    for override, message in [("trainer.strategy=horovod", "trainer.strategy='horovod' is not valid; choose one of: "
                                                         "auto, ddp, fsdp"),
                              ("trainer.num_nodes=0", "trainer.num_nodes=0 is not valid: must be >= 1")]:
        with pytest.raises(UserError, match=re.escape(message)):
            typed(composed(["conf=eagle3_pycode", "trainer=ddp", override]))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_train_as_one_with_the_same_global_batch(strategy, llama_dir, tmp_path):
    """fsdp: each process holds half of the drafter's weights, gradients and optimizer state."""
    out = tmp_path / f"{strategy}.json"
    two = two_processes(llama_dir, out, strategy)
    last = DDP_STEPS + 2
    single, _ = train(str(llama_dir), devices=1, max_steps=last, run_dir=tmp_path / "single",
                      weights_at=(DDP_STEPS, last))  # meanwhile
    _, stderr = two.communicate(timeout=600)
    assert two.returncode == 0, stderr[-3000:]
    ddp = json.loads(out.read_text())
    assert ddp["world_size"] == 2 and ddp["backend"] == "gloo"
    assert ddp["weights_held"] == 1.0 if strategy == "ddp" else 0.45 < ddp["weights_held"] < 0.55

    for step in range(1, DDP_STEPS + 1):
        rank0, rank1 = ddp["rows"][str(step)][:2], ddp["rows"][str(step)][2:]
        assert sorted(rank0 + rank1) == sorted(single.rows[step])  # the global batch, split between the two
        assert not set(map(tuple, rank0)) & set(map(tuple, rank1))
    differences = [abs(ddp["losses"][str(s)] - single.losses[s]) / single.losses[s] for s in range(1, DDP_STEPS + 1)]
    print(f"{strategy} vs 1 process, relative loss differences per step: {differences}")
    assert max(differences) < TOLERANCE, differences

    weights = torch.load(out.with_suffix(".pt"), weights_only=True)
    assert weights.keys() == single.weights[DDP_STEPS].keys()
    drift = max(float((weights[n] - single.weights[DDP_STEPS][n]).abs().max()) for n in weights)
    print(f"{strategy} vs 1 process, largest weight difference after {DDP_STEPS} steps: {drift:.2e}")
    assert drift < WEIGHT_TOLERANCE

    # The checkpoint counts the rows both processes consumed; one process resumes from it exactly there
    # and ends where the one that trained alone throughout does.
    checkpoint = torch.load(tmp_path / strategy / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["TextDataModule"]["rows_consumed"] == DDP_STEPS * GLOBAL_BATCH
    resumed, _ = train(str(llama_dir), devices=1, max_steps=last, run_dir=tmp_path / "resumed",
                       resume=str(tmp_path / strategy), weights_at=(last,))
    assert sorted(resumed.rows) == [DDP_STEPS + 1, last]
    assert all(resumed.rows[s] == single.rows[s] for s in resumed.rows)
    differences = [abs(resumed.losses[s] - single.losses[s]) / single.losses[s] for s in resumed.rows]
    drift = max(float((resumed.weights[last][n] - single.weights[last][n]).abs().max()) for n in weights)
    print(f"{strategy} of 2 resumed by 1 process: relative loss differences {differences}, largest weight "
          f"difference {drift:.2e}")
    assert max(differences) < TOLERANCE and drift < WEIGHT_TOLERANCE


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_train_py_with_trainer_ddp_runs_two_processes_and_exports_once(strategy, llama_dir, tmp_path):
    """`python train.py trainer=ddp|fsdp`: Lightning starts the second process; one process exports.
    fsdp also serves the sharded drafter during training (serve_eval) and exports its whole weights."""
    docs = [part for text in corpus()["train"]["text"] for part in text.split("\n\n") if part.strip()]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    run_dir, steps, batch, seq_len = tmp_path / "run", 2, 2, 64
    args = [
        "conf=eagle3_pycode", f"trainer={strategy}", "data=text", f"data.path={path}", f"data.seq_len={seq_len}",
        f"data.batch_size={batch}", "data.max_val_sequences=2", f"trainer.max_steps={steps}", "logger=none",
        f"hydra.run.dir={run_dir}", f"target.name_or_path={llama_dir}",
        "target.layer_ids=[" + ",".join(map(str, LAYER_IDS)) + "]", "drafter.draft_vocab_size=96",
        "drafter.depth=2", f"serve_eval.every_n_steps={steps if strategy == 'fsdp' else 0}",
        "serve_eval.max_new_tokens=8", f"trainer.val_every_n_steps={steps}",
        f"trainer.checkpoint_every_n_steps={steps}", "trainer.progress_bar=false",
    ]
    result = run_train(args, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "train_ddp_process_1.log").is_file()  # the second process's Hydra log
    assert result.stdout.count("export: ") == 1 and result.stdout.count("data train: ") == 1
    training = json.loads((run_dir / "export" / "training.json").read_text())
    assert training["steps"] == steps and training["tokens_seen"] == steps * batch * 2 * seq_len
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["TextDataModule"]["rows_consumed"] == steps * batch * 2
    exported, _ = export.load(run_dir / "export")  # whole weights, equal to the checkpoint's
    frozen = {name for name, p in exported.named_parameters() if not p.requires_grad}
    for name, weight in exported.state_dict().items():
        if name not in frozen or strategy == "fsdp":  # the target's frozen embedding: in fsdp's checkpoints only
            assert torch.equal(weight, checkpoint["state_dict"][f"drafter.{name}"]), name
        else:
            assert f"drafter.{name}" not in checkpoint["state_dict"], name
    assert json.loads((run_dir / "acceptance" / "report.json").read_text())["outputs_match_baseline"]
    assert not (run_dir / UNFINISHED).exists()  # process 0 finished the run; the other left the marker to it
    if strategy == "ddp":  # the same command again (every node of a restarted job): refused, not started over
        again = run_train(args, cwd=tmp_path, timeout=600)
        assert again.returncode == 1 and again.stderr.strip().splitlines()[-1].startswith(
            f"error: {run_dir} holds a finished run"), again.stderr[-3000:]


def two_processes(target_dir: Path, out: Path, strategy: str, *resume: str) -> subprocess.Popen:
    """This file as a script, the 2-process run: DDP_STEPS steps, or from `resume` (a run dir) to DDP_STEPS + 2."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.Popen([sys.executable, __file__, str(target_dir), str(out), strategy, *resume], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_process_resumed_by_two_trains_as_one_uninterrupted(strategy, llama_dir, tmp_path):
    """A run continued on more processes (here 1 by 2; 2 by 1 above) with the same global batch: the same
    rows in each step, the same losses and weights as the run that went on with one, to rounding (the
    order in which a step's rows are summed is what differs). Its last step is off the checkpoint interval:
    the checkpoint saved when training ends (train.trainer.save_final_checkpoint) is taken by every process."""
    train(str(llama_dir), devices=1, max_steps=DDP_STEPS, run_dir=tmp_path / "first")
    out = tmp_path / "resumed_by_two.json"
    two = two_processes(llama_dir, out, strategy, str(tmp_path / "first"))
    last = DDP_STEPS + 2
    straight, _ = train(str(llama_dir), devices=1, max_steps=last, run_dir=tmp_path / "straight", weights_at=(last,))
    _, stderr = two.communicate(timeout=600)
    assert two.returncode == 0, stderr[-3000:]
    resumed = json.loads(out.read_text())
    assert resumed["world_size"] == 2 and sorted(map(int, resumed["rows"])) == [DDP_STEPS + 1, last]
    for step in (DDP_STEPS + 1, last):
        assert sorted(resumed["rows"][str(step)]) == sorted(straight.rows[step])
    differences = [abs(resumed["losses"][str(s)] - straight.losses[s]) / straight.losses[s] for s in (DDP_STEPS + 1, last)]
    weights = torch.load(out.with_suffix(".pt"), weights_only=True)
    drift = max(float((weights[n] - straight.weights[last][n]).abs().max()) for n in weights)
    print(f"1 process resumed by 2 ({strategy}): relative loss differences {differences}, largest weight difference {drift:.2e}")
    assert max(differences) < TOLERANCE and drift < WEIGHT_TOLERANCE
    final = torch.load(tmp_path / "resumed_by_two" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert final["global_step"] == last and final["TextDataModule"]["rows_consumed"] == last * GLOBAL_BATCH


if __name__ == "__main__":
    target_dir, out, strategy, *resume = sys.argv[1], Path(sys.argv[2]), sys.argv[3], *sys.argv[4:]
    if resume:
        record, trainer = train(target_dir, devices=2, max_steps=DDP_STEPS + 2, run_dir=out.parent / "resumed_by_two",
                                resume=resume[0], strategy=strategy, weights_at=(DDP_STEPS + 2,))
    else:
        record, trainer = train(target_dir, devices=2, max_steps=DDP_STEPS, run_dir=out.parent / strategy,
                                strategy=strategy)
    if trainer.is_global_zero:
        torch.save(record.weights[max(record.weights_at)], out.with_suffix(".pt"))
        out.write_text(json.dumps({"losses": record.losses, "rows": record.rows, "backend": record.backend, "weights_held": record.weights_held,
                                   "world_size": trainer.world_size}))
