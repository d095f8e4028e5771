"""The hidden-state cache (train/hidden_cache.py): training from it gives the online loss, a
cache built for anything else is refused, and its bytes per token are what its shards hold."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import LAYER_IDS
from test_cli import REPO, run_train
from test_config import composed, typed
from transformers import AutoConfig

from common.config import UserError
from speculators.target import FrozenTarget
from train import hidden_cache
from train.data import DataConfig, EndlessShuffle, TextDataModule, load_examples
from train.module import DrafterModule
from train.optim import OptimConfig

SEQ_LEN, ROWS_PER_SHARD = 32, 3
# Relative loss difference allowed (measured on the tiny Llama: bf16 1e-5 to 3.3e-5, fp8 4e-4 to 1.8e-3);
# float32 storage is exact: same hidden states, same lm_head.
TOLERANCE = {"float32": 0.0, "bfloat16": 3e-4, "float8_e4m3": 1e-2}


def recipe_for(target_dir, data_file, cache_dir, *overrides):
    recipe, _ = typed(composed([
        "conf=eagle3_pycode", "data=text", f"data.path={data_file}", f"data.seq_len={SEQ_LEN}", "data.batch_size=2",
        "data.max_val_sequences=4", "data.hidden_states=cache", f"data.cache_dir={cache_dir}",
        f"target.name_or_path={target_dir}", "target.layer_ids=[" + ",".join(map(str, LAYER_IDS)) + "]", *overrides]))
    return recipe


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    lines = [line for line in Path(textwrap.__file__).read_text().splitlines() if line.strip()]
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": "\n".join(lines[i : i + 4])}) + "\n" for i in range(0, 400, 4)))
    return path


@pytest.fixture(scope="module")
def caches(llama_dir, data_file, tmp_path_factory) -> dict[str, Path]:
    """cache dtype -> a cache of the tiny Llama, in shards of ROWS_PER_SHARD rows (so rows cross shards)."""
    root, built = tmp_path_factory.mktemp("caches"), {}
    with pytest.MonkeyPatch.context() as patch:
        for dtype, itemsize in (("float32", 4), ("bfloat16", 2), ("float8_e4m3", 1)):
            patch.setattr(hidden_cache, "SHARD_BYTES", ROWS_PER_SHARD * (len(LAYER_IDS) + 1) * SEQ_LEN * 32 * itemsize)
            recipe = recipe_for(llama_dir, data_file, root / dtype, f"data.cache_dtype={dtype}")
            built[dtype] = hidden_cache.build(recipe)
    return built


def cached_data(recipe):
    """The data module and head-only target a cached training run builds."""
    head = FrozenTarget.load(recipe.target, recipe.quant, layers=False)
    data = TextDataModule(recipe.data, load_examples(recipe.data), head.tokenizer, recipe.seed)
    data.setup("fit")
    data.hidden = hidden_cache.open_cache(recipe, head, data)
    return head, data


@pytest.mark.parametrize("dtype", TOLERANCE)
def test_training_from_the_cache_gives_the_online_loss(llama_dir, llama_target, make_drafter, data_file, caches, dtype):
    recipe = recipe_for(llama_dir, data_file, caches[dtype], f"data.cache_dtype={dtype}")
    head, data = cached_data(recipe)
    assert not head.layers and head.num_layers == llama_target.num_layers
    assert head.fingerprint() == llama_target.fingerprint()
    drafter = make_drafter(llama_target)
    online, cached = (DrafterModule(drafter, t, OptimConfig(), 1) for t in (llama_target, head))
    stream = EndlessShuffle(data.train_rows, data.train_mask, seed=0, extra=data.extra("train"))
    train_batch = torch.utils.data.default_collate([item for item, _ in zip(stream, range(8))])  # crosses shards
    for batch in (train_batch, next(iter(data.val_dataloader()))):
        ids, mask = batch["input_ids"], batch["loss_mask"]
        loss_online, _ = drafter.training_loss(online.target_outputs({"input_ids": ids, "loss_mask": mask}), ids, mask)
        loss_cached, _ = drafter.training_loss(cached.target_outputs(batch), ids, mask)
        if dtype == "float32":
            assert torch.equal(loss_cached, loss_online)
        else:
            assert abs(loss_cached - loss_online) <= TOLERANCE[dtype] * loss_online


def test_the_cache_stores_the_argmax_and_lm_head_computes_only_the_logits_asked_for(llama_dir, llama_target, data_file,
                                                                                   caches):
    recipe = recipe_for(llama_dir, data_file, caches["float32"], "data.cache_dtype=float32")
    head, data = cached_data(recipe)
    row, online = data.hidden.row("train", 1), llama_target(data.train_rows[1:2])
    assert torch.equal(row["greedy"], online.logits.argmax(-1)[0])
    aux, last = list(row["aux_hidden"][None].unbind(1)), row["last_hidden"][None]
    out = head.from_hidden(aux, last, row["greedy"][None])
    assert out.logits is None and torch.equal(out.argmax(), online.logits.argmax(-1))
    draft_vocab = torch.tensor([7, 0, 33, 5])
    assert torch.allclose(out.logits_at(draft_vocab), online.logits[..., draft_vocab], rtol=1e-5, atol=1e-5)
    assert torch.allclose(out.full_logits(), online.logits, rtol=1e-5, atol=1e-5)
    older = head.from_hidden(aux, last)  # a cache built before the argmax was stored: lm_head over the whole vocab
    assert torch.equal(older.argmax(), out.argmax()) and torch.equal(older.logits_at(draft_vocab), older.logits[..., draft_vocab])


@pytest.mark.parametrize("dtype, itemsize", [("float32", 4), ("bfloat16", 2), ("float8_e4m3", 1)])
def test_bytes_per_token_is_what_the_shards_hold(caches, dtype, itemsize):
    index = json.loads((caches[dtype] / "index.json").read_text())
    files = sorted(p.name for p in caches[dtype].glob("*.safetensors"))
    assert files == sorted(shard["file"] for split in index["shards"].values() for shard in split)
    assert len(index["shards"]["train"]) > 1 and index["rows"]["train"] > ROWS_PER_SHARD
    size = sum((caches[dtype] / f).stat().st_size for f in files)
    tokens = sum(index["rows"].values()) * SEQ_LEN
    assert index["bytes"] == size and index["bytes_per_token"] == size / tokens
    payload = (len(LAYER_IDS) + 1) * (32 * itemsize + (4 if dtype == "float8_e4m3" else 0)) + 4  # fp8 scale, int32 argmax
    assert payload <= index["bytes_per_token"] < payload * 1.1  # the rest: safetensors headers
    assert index["layer_ids"] == LAYER_IDS and index["seq_len"] == SEQ_LEN and index["dtype"] == dtype


@pytest.mark.parametrize("override, key", [
    ("target.layer_ids=[1,2,3]", "layer_ids"), ("target.name_or_path={qwen3}", "target_fingerprint"),
    ("quant=int8", "quant"), ("data.cache_dtype=float32", "dtype"), ("data.seq_len=48", "seq_len"),
    ("data.max_val_sequences=3", "data_fingerprint"),
])
def test_a_cache_built_for_anything_else_is_refused_naming_both(llama_dir, qwen3_dir, data_file, caches, override, key):
    recipe = recipe_for(llama_dir, data_file, caches["bfloat16"], override.format(qwen3=qwen3_dir))
    with pytest.raises(UserError) as error:
        cached_data(recipe)
    built = json.loads((caches["bfloat16"] / "index.json").read_text())[key]
    assert f"was built for {key} {built}" in str(error.value) and f"this run has {key} " in str(error.value)
    assert "\n" not in str(error.value)


def test_the_first_examples_of_a_grown_file_keep_their_cache(llama_dir, data_file, caches, tmp_path, capsys):
    """data.max_examples: regeneration appends to the data a cache was built from, training still reads it."""
    grown = tmp_path / "docs.jsonl"
    grown.write_text(data_file.read_text() + "".join(json.dumps({"text": f"later {i}"}) + "\n" for i in range(40)))
    with pytest.raises(UserError, match="data_fingerprint"):
        cached_data(recipe_for(llama_dir, grown, caches["bfloat16"]))
    _, data = cached_data(recipe_for(llama_dir, grown, caches["bfloat16"], "data.max_examples=100"))
    assert data.hidden is not None
    assert "data: the first 100 of 140 examples (data.max_examples=100)" in capsys.readouterr().out
    _, data = cached_data(recipe_for(llama_dir, data_file, caches["bfloat16"], "data.max_examples=500"))
    assert "data: the first 100 of 100 examples (data.max_examples=500)" in capsys.readouterr().out


def stop_after_two_shards(monkeypatch, recipe) -> list[str]:
    """Build `recipe` with shards of ROWS_PER_SHARD rows, stopped (Ctrl-C) when writing its third shard;
    returns the list every shard written from now on is appended to."""
    monkeypatch.setattr(hidden_cache, "SHARD_BYTES", ROWS_PER_SHARD * (len(LAYER_IDS) + 1) * SEQ_LEN * 32 * 2)
    save, written = hidden_cache.save_shard, []

    def save_then_stop(tensors, path):
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(path.name)
        return save(tensors, path)

    monkeypatch.setattr(hidden_cache, "save_shard", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        hidden_cache.build(recipe)
    assert not Path(recipe.data.cache_dir).exists()
    written.clear()
    monkeypatch.setattr(hidden_cache, "save_shard", lambda tensors, path: (written.append(path.name), save(tensors, path))[1])
    return written


def same_cache(built: Path, reference: Path) -> None:
    """The same shard files, bytes and index as a build made in one go."""
    whole = sorted(p.name for p in reference.glob("*.safetensors"))
    assert sorted(p.name for p in built.glob("*.safetensors")) == whole
    for name in whole:
        assert (built / name).read_bytes() == (reference / name).read_bytes()
    assert (built / "index.json").read_text() == (reference / "index.json").read_text()
    assert not (built / "progress.json").exists()


def test_a_stopped_build_resumes_after_its_last_shard(llama_dir, data_file, caches, tmp_path, monkeypatch, capsys):
    recipe = recipe_for(llama_dir, data_file, tmp_path / "cache", "data.cache_dtype=bfloat16")
    written = stop_after_two_shards(monkeypatch, recipe)
    hidden_cache.build(recipe)
    rows = sum(json.loads((caches["bfloat16"] / "index.json").read_text())["rows"].values())
    assert (f"{2 * ROWS_PER_SHARD} of {rows} rows already built ({tmp_path / 'cache.partial'}), computing the rest"
            in capsys.readouterr().out)
    assert len(written) == len(list(caches["bfloat16"].glob("*.safetensors"))) - 2
    same_cache(tmp_path / "cache", caches["bfloat16"])


def test_a_stopped_build_of_other_settings_starts_over(llama_dir, data_file, caches, tmp_path, monkeypatch, capsys):
    stop_after_two_shards(monkeypatch, recipe_for(llama_dir, data_file, tmp_path / "cache", "data.cache_dtype=float32"))
    stop_after_two_shards(monkeypatch, recipe_for(llama_dir, data_file, tmp_path / "cache"))
    assert "already built" not in capsys.readouterr().out
    hidden_cache.build(recipe_for(llama_dir, data_file, tmp_path / "cache"))
    assert "already built" in capsys.readouterr().out
    same_cache(tmp_path / "cache", caches["bfloat16"])


def test_a_cache_rebuilt_for_a_grown_file_computes_only_the_new_rows(llama_dir, data_file, tmp_path, monkeypatch,
                                                                      capsys):
    """Regeneration appends conversations: the cache of the first 60 grows to 100 reusing its whole
    shards, byte for byte what a build of the 100 from nothing writes."""
    monkeypatch.setattr(hidden_cache, "SHARD_BYTES", ROWS_PER_SHARD * (len(LAYER_IDS) + 1) * SEQ_LEN * 32 * 2)
    small = hidden_cache.build(recipe_for(llama_dir, data_file, tmp_path / "cache", "data.max_examples=60"))
    old_shards = json.loads((small / "index.json").read_text())["shards"]["train"]
    reference = hidden_cache.build(recipe_for(llama_dir, data_file, tmp_path / "reference"))
    capsys.readouterr()
    save, written = hidden_cache.save_shard, []
    monkeypatch.setattr(hidden_cache, "save_shard", lambda tensors, path: (written.append(path.name), save(tensors, path))[1])
    with pytest.raises(UserError, match="already exists; pass overwrite=true"):
        hidden_cache.build(recipe_for(llama_dir, data_file, small))
    hidden_cache.build(recipe_for(llama_dir, data_file, small, "overwrite=true"))
    assert f"rows already built ({small}), computing the rest" in capsys.readouterr().out
    assert len(old_shards) > 2 and written  # the new rows were computed, the old full shards kept:
    assert not {shard["file"] for shard in old_shards[:-1]} & set(written)
    same_cache(small, reference)
    assert not small.with_name("cache.partial").exists() and not small.with_name("cache.previous").exists()


def test_a_missing_cache_and_an_existing_output_are_one_line_errors(llama_dir, data_file, caches, tmp_path):
    with pytest.raises(UserError, match="holds no hidden-state cache"):
        cached_data(recipe_for(llama_dir, data_file, tmp_path / "none"))
    with pytest.raises(UserError, match="already exists; pass overwrite=true"):
        hidden_cache.build(recipe_for(llama_dir, data_file, caches["bfloat16"]))
    with pytest.raises(UserError, match="data.cache_dir=None .* set for data.hidden_states=cache"):
        recipe_for(llama_dir, data_file, "null")
    with pytest.raises(UserError, match="data.cache_dtype"):
        recipe_for(llama_dir, data_file, tmp_path, "data.cache_dtype=int4")
    with pytest.raises(UserError, match="data.max_examples=0 .* >= 1"):
        recipe_for(llama_dir, data_file, tmp_path, "data.max_examples=0")
    with pytest.raises(UserError, match="data.max_examples=3 .* unset for data.source=stdlib"):
        DataConfig(max_examples=3)


def test_the_target_without_layers_refuses_to_run(llama_dir, llama_target, text_batch):
    head = FrozenTarget(llama_target.model, llama_target.tokenizer, str(llama_dir), LAYER_IDS, layers=False)
    with pytest.raises(RuntimeError, match="without its decoder layers"):
        head(text_batch)


def test_build_then_train_from_the_cache_on_the_command_line(llama_dir, data_file, tmp_path):
    common = ["conf=eagle3_pycode", "data=text", f"data.path={data_file}", f"data.seq_len={SEQ_LEN}", "data.batch_size=2",
              "data.max_val_sequences=2", "data.hidden_states=cache", f"data.cache_dir={tmp_path / 'cache'}",
              f"target.name_or_path={llama_dir}", "target.layer_ids=[" + ",".join(map(str, LAYER_IDS)) + "]",
              "trainer.num_threads=1", "logger=none"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
    built = subprocess.run([sys.executable, "-m", "train.hidden_cache", *common, f"hydra.run.dir={tmp_path / 'b'}"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    assert "bytes per token" in built.stdout.splitlines()[-1]

    train = common + ["trainer.max_steps=2", "drafter.depth=2", "drafter.draft_vocab_size=64",
                      "trainer.val_every_n_steps=2", "trainer.checkpoint_every_n_steps=2", "trainer.progress_bar=false",
                      f"hydra.run.dir={tmp_path / 'run'}"]
    refused = run_train(train, cwd=tmp_path, timeout=600)  # eagle3.yaml serves the drafter every 100 steps
    assert refused.returncode != 0 and "serve_eval.every_n_steps=100 is not valid" in refused.stderr.splitlines()[-1]
    result = run_train(train + ["serve_eval.every_n_steps=0"], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "export" / "config.json").is_file() and "acceptance report:" in result.stdout


FAKE_VLLM_RUNNER = '''
"""engines/vllm_runner.py --hidden's contract, kept by transformers: vLLM's aux layer id l is the input of decoder
layer l, id num_hidden_layers the last layer's output before the final norm."""
import json, sys
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
mode, engine = sys.argv[1], json.loads(sys.argv[2])
import os
with open(os.environ["FAKE_VLLM_ENGINE"], "w") as f:
    json.dump(engine, f)
model = AutoModelForCausalLM.from_pretrained(engine["model"], dtype=torch.float32).eval()
before_norm = {}
model.model.norm.register_forward_pre_hook(lambda module, args: before_norm.__setitem__("x", args[0]))
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    with torch.no_grad():
        out = model(torch.tensor(request["rows"]), output_hidden_states=True)
    last = model.config.num_hidden_layers
    states = [before_norm["x"] if l == last else out.hidden_states[l] for l in engine["layers"]]
    save_file({"hidden": torch.stack(states, 2).contiguous()}, request["file"])
    print(json.dumps({"file": request["file"]}), flush=True)
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """vLLM's venv played by ours: the runner replaced by FAKE_VLLM_RUNNER."""
    from engines import vllm_venv

    runner = tmp_path / "fake_vllm_runner.py"
    runner.write_text(FAKE_VLLM_RUNNER)
    monkeypatch.setattr(vllm_venv, "RUNNER", runner)
    monkeypatch.setenv("VLLM_CPU_PYTHON", sys.executable)
    monkeypatch.setenv("FAKE_VLLM_ENGINE", str(tmp_path / "engine.json"))  # what the runner was asked for
    return vllm_venv


@pytest.mark.parametrize("workers", [1, 2])
def test_a_cache_built_through_vllm_equals_the_targets(llama_dir, data_file, caches, tmp_path, fake_vllm, monkeypatch,
                                                       workers):
    monkeypatch.setattr(fake_vllm, "worker_devices", lambda count, key: [{}] * workers)  # as if `workers` GPUs
    monkeypatch.setattr(hidden_cache, "SHARD_BYTES", ROWS_PER_SHARD * (len(LAYER_IDS) + 1) * SEQ_LEN * 32 * 4)
    recipe = recipe_for(llama_dir, data_file, tmp_path / "vllm", "data.cache_dtype=float32", "data.cache_engine=vllm")
    built, reference = hidden_cache.build(recipe), caches["float32"]
    engine = json.loads((tmp_path / "engine.json").read_text())
    assert engine["layers"] == [*LAYER_IDS, AutoConfig.from_pretrained(llama_dir).num_hidden_layers]
    assert engine["max_model_len"] == SEQ_LEN + 1 and engine["model"] == str(llama_dir)
    index, expected = json.loads((built / "index.json").read_text()), json.loads((reference / "index.json").read_text())
    assert index["engine"].startswith("vLLM") and expected["engine"] == "transformers"
    def settled(index):  # the float32 states agree to rounding, so the shards' checksums differ
        shards = {split: [{k: v for k, v in s.items() if k != "sha256"} for s in shards]
                  for split, shards in index["shards"].items()}
        return {k: v for k, v in index.items() if k != "engine"} | {"shards": shards}

    assert settled(index) == settled(expected)
    for name in sorted(p.name for p in reference.glob("*.safetensors")):
        ours, theirs = (hidden_cache.safe_open(str(folder / name), "pt") for folder in (built, reference))
        assert torch.equal(ours.get_tensor("greedy"), theirs.get_tensor("greedy"))
        torch.testing.assert_close(ours.get_tensor("hidden"), theirs.get_tensor("hidden"), rtol=1e-5, atol=1e-5)


def test_vllm_refuses_a_target_it_would_not_serve_as_trained(llama_dir, data_file, tmp_path, fake_vllm):
    recipe = recipe_for(llama_dir, data_file, tmp_path / "c", "data.cache_engine=vllm", "quant=int8")
    with pytest.raises(UserError, match="data.cache_engine=vllm runs the target as stored"):
        hidden_cache.build(recipe)
    assert not (tmp_path / "c").exists()
