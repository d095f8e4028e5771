"""benchmarks/peers: the peer trainers' runners. Without the network: each venv's install commands and the
on-demand install (subprocess mocked), the flags and specs they pass, the rows they share with train/data.py,
the conversion of the peers' outputs to our export. Opt-in (`engines`, slow): a 2-step training of each peer in
its venv, when that venv exists, converted and loaded by our reader."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from benchmarks import peers
from benchmarks.peers import Venv, modelopt_peer, speculators_peer
from common.config import UserError


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECULATORS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_speculators_venv_installs_torch_first_then_the_peer_without_its_pins(cache):
    commands = speculators_peer.VENV.commands()
    venv = cache / "peers" / "speculators-0.9.0" / "venv"
    assert commands[0] == [sys.executable, "-m", "venv", str(venv)]
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    assert commands[1] == [*pip, "torch==2.13.0"]  # its own pins would pull torch 2.14's CUDA wheels
    assert commands[2] == [*pip, "--no-deps", "speculators==0.9.0", "hs-connectors==0.9.0"]
    assert commands[3][:len(pip)] == pip and "transformers>=5.0.0,<=5.19.0" in commands[3]
    assert not any("torch" == a.split("=")[0] for a in commands[3])


def test_modelopt_venv_keeps_transformers_below_its_cap(cache):
    commands = modelopt_peer.VENV.commands()
    assert commands[0][-1] == str(cache / "peers" / "modelopt-0.47.0" / "venv")
    assert commands[1][-1] == "torch==2.13.0"
    assert {"nvidia-modelopt==0.47.0", "transformers>=4.57,<5.15", "requests"} <= set(commands[2])


def test_ensure_installs_once_and_says_how_when_told_not_to(cache, monkeypatch):
    venv = Venv("toy-1.0", (("toy==1.0",),))
    with pytest.raises(UserError, match=r"no toy-1.0 venv at .*: make it with `.* -m venv .* && .*pip install --quiet toy==1.0`"):
        venv.ensure(install=False)
    ran = []

    def fake_run(command, **kw):
        ran.append(command)
        if command[1:3] == ["-m", "venv"]:
            (venv.python.parent).mkdir(parents=True)
            venv.python.write_text("#!/bin/sh\n")
            venv.python.chmod(0o755)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(peers.subprocess, "run", fake_run)
    assert venv.ensure() == venv.python and ran == venv.commands()
    assert json.loads((venv.path / "installed.json").read_text())["commands"] == venv.commands()
    ran.clear()
    venv.ensure()
    assert ran == []  # made once


def test_a_failed_install_is_one_line(cache, monkeypatch):
    venv = Venv("toy-1.0", (("toy==1.0",),))
    monkeypatch.setattr(peers.subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(
        command, 1, "", "Collecting toy==1.0\nERROR: No matching distribution found for toy==1.0\n"))
    with pytest.raises(UserError, match=r"installing toy-1.0 failed at `.* -m venv .*`: .*No matching distribution"):
        venv.ensure()
    assert not (venv.path / "installed.json").exists()


def test_workers_run_in_their_venv_without_our_paths(cache, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = speculators_peer.VENV.env(1)
    assert "PYTHONPATH" not in env and "VIRTUAL_ENV" not in env and env["OMP_NUM_THREADS"] == "1"
    assert env["PATH"].startswith(str(speculators_peer.VENV.python.parent)) and env["HF_HUB_OFFLINE"] == "1"
    # vLLM's package is called `speculators` too: a worker must never import ours (nor sit beside a file of that name)
    for worker in ("speculators_worker.py", "modelopt_worker.py"):
        text = (peers.HERE / worker).read_text()
        assert "from benchmarks" not in text and "import common" not in text and "from common" not in text
    assert not {"speculators.py", "modelopt.py", "torch.py", "transformers.py"} & {p.name for p in peers.HERE.iterdir()}


def test_speculators_flags_are_our_recipe(tmp_path):
    (tmp_path / "split.json").write_text(json.dumps({"train_data_ratio": 0.93}))
    args = speculators_peer.train_args(Path("/t"), tmp_path, tmp_path / "w", 40, {"SEED": "3", "EXTRA": "--optimizer muon"})

    def value(flag):
        return args[args.index(flag) + 1]

    assert value("--max-steps") == "40" and value("--seed") == "3" and value("--train-data-ratio") == "0.93"
    assert value("--ttt-steps") == "5" and value("--ttt-step-loss-decay") == "0.8" and value("--lr") == "1e-3"
    assert value("--total-seq-len") == "2048" and value("--draft-vocab-size") == "8192" and value("--weight-decay") == "0"
    assert args[args.index("--target-layer-ids") + 1:][:3] == ["2", "15", "27"]
    assert {"--no-norm-before-fc", "--no-norm-output", "--no-norm-before-residual"} <= set(args)
    assert value("--draft-attn-impl") == "sdpa" and value("--loss-implementation") == "eager" and value("--num-workers") == "0"
    assert args[-2:] == ["--optimizer", "muon"]  # EXTRA last: it wins


def test_speculators_checkpoint_becomes_our_export(tmp_path):
    ckpt = tmp_path / "final"
    ckpt.mkdir()
    save_file({"fc.weight": torch.zeros(576, 3 * 576)}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps({"target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": [2, 15, 27],
                                                  "auto_map": {"AutoConfig": "config.X"}, "dtype": "float32",
                                                  "speculators_config": {"verifier": {"name_or_path": "/tmp/hf"}}}))
    (ckpt / "optimizer_state_dict.pt").write_text("")
    out = speculators_peer.export(ckpt, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["target_hidden_size"] == 576 and "auto_map" not in config and config["torch_dtype"] == "float32"
    assert config["speculators_config"]["verifier"] == {"name_or_path": peers.TARGET, "architectures": []}
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_modelopt_spec_is_our_recipe_in_its_numbering(tmp_path, monkeypatch):
    monkeypatch.setattr(modelopt_peer, "target_folder", lambda: Path("/t"))
    s = modelopt_peer.spec(384, 40, tmp_path, {"SEED": "2"})
    assert s["layers"] == [1, 14, 26]  # it hooks the output of layer i: our hidden_states[i + 1]
    assert (s["steps"], s["batch_size"], s["seq_len"], s["ttt"], s["decay"], s["lr"], s["warmup"]) == (40, 4, 512, 5, 0.8, 1e-3, 10)
    assert s["betas"] == [0.9, 0.95] and s["draft_vocab"] == 8192 and s["seed"] == 2 and s["dtype"] == "float32"


def test_modelopt_d2t_is_our_draft_vocabulary(tmp_path, monkeypatch):
    target = tmp_path / "t"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"vocab_size": 10}))
    monkeypatch.setattr(modelopt_peer, "target_folder", lambda: target)
    rows = {"train": [[[1, 5, 5, 7, 9], [0, 1, 1, 1, 0]], [[7, 3], [1, 1]]], "validation": [[[2, 2], [1, 1]]]}
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    d2t = torch.load(modelopt_peer.draft_vocab(tmp_path / "rows.json", tmp_path / "d2t.pt", 3))
    assert (torch.arange(3) + d2t).tolist() == [3, 5, 7]  # trained tokens of the train rows only, by count


def test_rows_are_train_data_py_rows(tmp_path):
    """The rows every peer trains on are the ones `python train.py data.max_examples=N` trains on."""
    from transformers import AutoTokenizer

    from train import data as tdata

    target = peers.target_folder()
    info = peers.write_rows(30, 64, tmp_path / "rows.json", target)
    rows = json.loads((tmp_path / "rows.json").read_text())
    cfg = tdata.DataConfig(source="file", path=str(Path(peers.DATA).resolve()), layout="messages", max_examples=30, seq_len=64)
    split = tdata.split_by_hash(tdata.read_examples(cfg))
    encode = tdata.example_encoder(cfg, AutoTokenizer.from_pretrained(target))
    expected = [encode(e) for e in split["train"]]
    expected = [[i[:64], [int(m) for m in k[:64]]] for i, k in expected if any(k[:64])]
    assert rows["train"] == expected and info["train_rows"] == len(expected) and info["conversations_read"] == 30
    assert len(rows["validation"]) <= len(split["validation"])


def trained_in_venv(module, tmp_path) -> Path:
    if not module.VENV.ready():
        pytest.skip(f"no {module.VENV.name} venv at {module.VENV.path} (python -m {module.__name__} makes it)")
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", module.__name__, "24", "2", str(tmp_path / "export"), str(tmp_path / "work")],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "[train_cpu] 2 steps" in done.stdout
    return tmp_path / "export"


@pytest.mark.engines
@pytest.mark.slow
@pytest.mark.parametrize("module", [speculators_peer, modelopt_peer], ids=["speculators", "modelopt"])
def test_two_peer_steps_in_its_venv_load_as_our_drafter(module, tmp_path):
    from speculators import export

    drafter, verifier = export.load(trained_in_venv(module, tmp_path))
    assert verifier == peers.TARGET and drafter.layer_ids == [2, 15, 27] and drafter.cfg.draft_vocab_size == 8192
