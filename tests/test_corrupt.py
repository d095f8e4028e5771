"""Corrupt or truncated checkpoints and exports are refused with one line naming the file, in
Python and through both CLIs; nothing half-read is trained on or served."""

import random
import shutil
from pathlib import Path

import pytest
import torch
from test_reliability import REPO, copy_small_stdlib, one_line_error, run_subprocess, tiny_training
from test_resume import train

from common.config import UserError
from speculators import export
from speculators.export import Verifier
from train.trainer import AtomicCheckpointIO


@pytest.fixture(scope="module")
def small_stdlib(tmp_path_factory) -> Path:
    return copy_small_stdlib(tmp_path_factory.mktemp("stdlib"))


@pytest.fixture(scope="module")
def tiny_export(llama_target, make_drafter, tmp_path_factory) -> Path:
    return export.save(make_drafter(llama_target), tmp_path_factory.mktemp("drafter") / "export",
                       Verifier.of(llama_target))


def flip_bytes(data: bytes, start: int, count: int = 16) -> bytes:
    damaged = bytearray(data)
    for i in range(start, min(start + count, len(data))):
        damaged[i] ^= 0xFF
    return bytes(damaged)


# name -> damage(file bytes); each leaves a file that must not load
TRUNCATIONS = {
    "empty": lambda data: b"",
    "first_bytes_only": lambda data: data[:7],
    "cut_in_half": lambda data: data[: len(data) // 2],
    "last_byte_missing": lambda data: data[:-1],
    "garbage": lambda data: random.Random(0).randbytes(len(data)),
}


@pytest.fixture(scope="module")
def checkpoint(llama_target, tmp_path_factory) -> Path:
    """A real last.ckpt, written by a 3-step drafter run."""
    run_dir = tmp_path_factory.mktemp("checkpointed")
    train(llama_target, run_dir, max_steps=3)
    return run_dir / "checkpoints" / "last.ckpt"


CHECKPOINT_DAMAGES = {**TRUNCATIONS,
                      # torch.load does not check the archive's checksums: flipped weights would load
                      "bytes_flipped_in_the_middle": lambda data: flip_bytes(data, len(data) // 2)}


@pytest.mark.parametrize("damage", CHECKPOINT_DAMAGES)
def test_a_damaged_checkpoint_is_refused_by_name(checkpoint, llama_target, tmp_path, damage):
    bad = tmp_path / "last.ckpt"
    bad.write_bytes(CHECKPOINT_DAMAGES[damage](checkpoint.read_bytes()))
    with pytest.raises(UserError) as error:
        train(llama_target, tmp_path / "resumed", max_steps=6, resume=str(bad))
    assert str(bad) in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "resumed" / "checkpoints").exists()  # refused before a single step


def test_the_undamaged_checkpoint_loads(checkpoint):
    """The control: the same reader accepts the file the damages start from."""
    assert AtomicCheckpointIO().load_checkpoint(checkpoint, weights_only=True)["global_step"] == 3


def test_a_file_that_is_no_training_checkpoint_is_refused(tmp_path):
    weights_only = tmp_path / "weights.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, weights_only)
    with pytest.raises(UserError, match=f"{weights_only} is not a training checkpoint"):
        AtomicCheckpointIO().load_checkpoint(weights_only, weights_only=True)


def export_damages(name: str) -> dict:
    damages = dict(TRUNCATIONS)
    if name == "model.safetensors":  # its JSON header: flipped tensor bytes carry no checksum to catch them
        damages["header_bytes_flipped"] = lambda data: flip_bytes(data, 12)
    else:
        damages["not_an_object"] = lambda data: b"[1, 2, 3]"
    return damages


@pytest.mark.parametrize("name, damage", [(name, damage) for name in ("model.safetensors", "config.json")
                                          for damage in export_damages(name)])
def test_a_damaged_export_is_refused_by_name(tiny_export, tmp_path, name, damage):
    bad = tmp_path / "export"
    shutil.copytree(tiny_export, bad)
    (bad / name).write_bytes(export_damages(name)[damage]((bad / name).read_bytes()))
    with pytest.raises(UserError) as error:
        export.load(bad)
    assert f"{bad}/{name}" in str(error.value) and "\n" not in str(error.value)


def test_the_undamaged_export_loads(tiny_export):
    drafter, verifier = export.load(tiny_export)
    assert verifier and sum(p.numel() for p in drafter.parameters()) > 0


def test_train_cli_refuses_a_truncated_checkpoint(checkpoint, llama_dir, small_stdlib, tmp_path):
    bad = tmp_path / "last.ckpt"
    bad.write_bytes(checkpoint.read_bytes()[:1000])
    run_dir = tmp_path / "run"
    code, stderr = run_subprocess([str(REPO / "train.py"), *tiny_training(llama_dir, small_stdlib, run_dir),
                                   f"resume={bad}"], cwd=tmp_path)
    assert str(bad) in one_line_error(code, stderr)
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "export").exists()


def test_inference_cli_refuses_a_corrupt_export(tiny_export, tmp_path):
    bad = tmp_path / "export"
    shutil.copytree(tiny_export, bad)
    (bad / "model.safetensors").write_bytes(random.Random(0).randbytes(5000))
    code, stderr = run_subprocess(["-m", "inference", f"drafter={bad}", f"hydra.run.dir={tmp_path / 'hydra'}",
                                   f"out={tmp_path / 'out'}"], cwd=REPO)
    assert f"{bad}/model.safetensors" in one_line_error(code, stderr)
    assert not (tmp_path / "out").exists()
