"""benchmarks.memory_plan: the drafter it plans is the one training builds (parameters, exactly), the
cache bytes per token are what a built hidden-state cache stores (exactly), the activations it counts are what
autograd saves in a real drafter, and the bundled 8B and 70B configs plan offline."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DRAFT_VOCAB, FAMILIES, LAYER_IDS, load_target
from safetensors import safe_open
from test_cli import REPO
from test_config import composed, typed
from transformers import AutoConfig

from benchmarks.memory_plan import MemoryPlanConfig, Target, drafter_on_meta, plan, saved_activations, shapes_of
from speculators.target import TargetOutput
from train import hidden_cache

DEPTH = 3  # conftest's make_drafter


def tiny_target(target_dir: Path) -> Target:
    return Target(str(target_dir), AutoConfig.from_pretrained(target_dir), "float32", LAYER_IDS)


def tiny_plan(target_dir: Path, **fields) -> MemoryPlanConfig:
    return MemoryPlanConfig(target=str(target_dir), depth=DEPTH, draft_vocab_size=DRAFT_VOCAB, **fields)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_planned_drafter_is_the_one_training_builds(family, target_dirs, make_drafter):
    target = load_target(target_dirs, family)
    real = make_drafter(target)
    meta = drafter_on_meta(tiny_target(target_dirs[family]), DEPTH, DRAFT_VOCAB)
    assert {n: p.shape for n, p in meta.state_dict().items()} == {n: p.shape for n, p in real.state_dict().items()}
    shapes = shapes_of(tiny_plan(target_dirs[family]), tiny_target(target_dirs[family]))
    assert shapes.trainable == sum(p.numel() for p in real.parameters() if p.requires_grad)
    assert shapes.frozen == sum(p.numel() for p in real.parameters() if not p.requires_grad)
    assert shapes.drafter_buffers == sum(b.numel() * b.element_size() for b in real.buffers())
    assert shapes.target_weights == sum(p.numel() * p.element_size() for p in target.model.parameters())


def test_cache_bytes_per_token_are_what_a_built_cache_stores(llama_dir, tmp_path):
    docs = tmp_path / "docs.jsonl"
    text = (REPO / "train" / "data.py").read_text()
    docs.write_text("".join(json.dumps({"text": part}) + "\n" for part in text.split("\n\n") if part.strip()))
    for dtype in ("bfloat16", "float8_e4m3"):
        recipe, _ = typed(composed([
            "conf=eagle3_pycode", "data=text", f"data.path={docs}", "data.seq_len=32", "data.batch_size=2",
            "data.max_val_sequences=2", "data.hidden_states=cache", f"data.cache_dir={tmp_path / dtype}",
            f"data.cache_dtype={dtype}", f"target.name_or_path={llama_dir}",
            "target.layer_ids=[" + ",".join(map(str, LAYER_IDS)) + "]"]))
        folder = hidden_cache.build(recipe)
        index = json.loads((folder / "index.json").read_text())
        stored, tokens = 0, sum(index["rows"].values()) * 32
        for shard in (shard for shards in index["shards"].values() for shard in shards):
            with safe_open(str(folder / shard["file"]), "pt") as f:
                stored += sum(f.get_tensor(name).numel() * f.get_tensor(name).element_size() for name in f.keys())
        planned = plan(tiny_plan(llama_dir, cache_dtype=dtype), tiny_target(llama_dir))["hidden_cache_bytes_per_token"]
        assert stored / tokens == planned  # the tensors; the files add their safetensors headers
        assert planned <= index["bytes_per_token"] < planned * 1.05


@pytest.mark.parametrize("mixed", [False, True])
def test_activation_counts_are_what_autograd_saves(llama_dir, llama_target, make_drafter, mixed):
    """32-true: within 3% (what the table leaves out: SDPA's logsumexp, index tensors, the mask's bias); under
    the CPU's autocast, whose op lists are not CUDA's, within 10%. The batch is random, its loss on 70%."""
    B, T = 8, 24
    drafter = make_drafter(llama_target)
    gen = torch.Generator().manual_seed(0)
    H, V = llama_target.hidden_size, llama_target.vocab_size
    out = TargetOutput([torch.randn(B, T, H, generator=gen) for _ in LAYER_IDS], torch.randn(B, T, H, generator=gen),
                       torch.randn(B, T, V, generator=gen))
    ids, mask = torch.randint(0, V, (B, T), generator=gen), (torch.rand(B, T, generator=gen) < 0.7).long()
    saved = {}

    def keep(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            drafter.training_loss(out, ids, mask)
    given = {t.untyped_storage().data_ptr() for t in (*drafter.parameters(), *out.aux_hidden, out.last_hidden, out.logits)}
    measured = sum(size for ptr, size in saved.items() if ptr not in given)
    weight_copies = 2 * sum(p.numel() for p in drafter.parameters() if p.requires_grad) if mixed else 0
    shapes = shapes_of(tiny_plan(llama_dir), tiny_target(llama_dir))
    planned = saved_activations(shapes, B * T, T, DEPTH, float(mask.float().mean()), mixed) + weight_copies
    print(f"saved activations ({'bf16-mixed' if mixed else '32-true'}): measured {measured}, planned {planned:.0f}")
    assert abs(planned / measured - 1) < (0.10 if mixed else 0.03)


@pytest.mark.parametrize("target, fits", [("llama3_8b", True), ("qwen3_8b", True), ("llama3_70b_offload", False)])
def test_the_bundled_configs_plan_offline(target, fits, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = plan(MemoryPlanConfig(target=target))
    assert result["fits"] == fits and (result["largest_batch"] >= 4) == fits
    if target == "llama3_8b":  # Llama-3.1-8B: 8,030,261,248 parameters in bf16
        assert result["target_weight_bytes"] == 2 * 8_030_261_248
        H, Q, KV, I, N = 4096, 4096, 1024, 14336, 32768  # fc, q/k/v from 2H, o, MLP, lm_head, four norms
        assert result["shapes"]["trainable"] == 3 * H * H + 2 * H * (Q + 2 * KV) + Q * H + 3 * H * I + N * H + 4 * H


def test_the_command_prints_the_table_and_writes_json_offline(tmp_path):
    out = tmp_path / "plan.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, "-m", "benchmarks.memory_plan", "target=llama3_8b", f"out={out}"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    assert "the largest batch that fits" in child.stdout and "drafter forward end <- peak" in child.stdout
    assert json.loads(out.read_text())["target"] == "meta-llama/Llama-3.1-8B-Instruct"
