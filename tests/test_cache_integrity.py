"""A damaged hidden-state cache (train/hidden_cache.py) is refused in one line naming what to do, never trained
on: a missing, truncated or bit-flipped shard, a broken or outdated index.json, a cache of a fine-tuned target
with the same embeddings; a rebuild recomputes only the bad shards; its files are written atomically."""

import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import LAYER_IDS
from test_corrupt import TRUNCATIONS, flip_bytes
from test_hidden_cache import ROWS_PER_SHARD, SEQ_LEN, cached_data, data_file, recipe_for, same_cache  # noqa: F401
from test_reliability import REPO
from transformers import AutoModelForCausalLM

from common import files
from common.config import UserError
from speculators.target import FrozenTarget, TargetConfig
from train import hidden_cache

SHARD_DAMAGES = {
    "missing": None,
    **{name: damage for name, damage in TRUNCATIONS.items() if name != "garbage"},
    "garbage": TRUNCATIONS["garbage"],  # the right size, none of the bytes
    "bytes_flipped_in_the_middle": lambda data: flip_bytes(data, len(data) // 2),
    "header_bytes_flipped": lambda data: flip_bytes(data, 12),
}
INDEX_DAMAGES = {**TRUNCATIONS, "not_an_object": lambda data: b"[1, 2, 3]", "no_shards": lambda data: b'{"dtype": 1}'}


@pytest.fixture(scope="module")
def cache(llama_dir, data_file, tmp_path_factory):  # noqa: F811
    """A bfloat16 cache of the tiny Llama in shards of ROWS_PER_SHARD rows."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hidden_cache, "SHARD_BYTES", ROWS_PER_SHARD * (len(LAYER_IDS) + 1) * SEQ_LEN * 32 * 2)
        return hidden_cache.build(recipe_for(llama_dir, data_file, tmp_path_factory.mktemp("cache") / "cache"))


def copy_of(cache, tmp_path):
    shutil.copytree(cache, tmp_path / "cache")
    return tmp_path / "cache"


def read_every_row(data) -> None:
    for split, rows in (("train", data.train_rows), ("validation", data.val_rows)):
        for i in range(len(rows)):
            data.hidden.row(split, i)


def shard_names(cache) -> list[str]:
    return [shard["file"] for shard in json.loads((cache / "index.json").read_text())["shards"]["train"]]


def one_line(error) -> str:
    assert "\n" not in str(error.value)
    return str(error.value)


def test_the_index_records_each_shards_size_and_checksum(cache):
    for name, shard in zip(shard_names(cache), json.loads((cache / "index.json").read_text())["shards"]["train"]):
        data = (cache / name).read_bytes()
        assert shard["bytes"] == len(data) and shard["sha256"] == hidden_cache.hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("damage", SHARD_DAMAGES)
def test_a_damaged_shard_is_refused_by_name_before_a_row_of_it_is_read(llama_dir, data_file, cache, tmp_path,  # noqa: F811
                                                                       damage):
    folder = copy_of(cache, tmp_path)
    shard = folder / shard_names(folder)[2]
    if SHARD_DAMAGES[damage] is None:
        shard.unlink()
    else:
        shard.write_bytes(SHARD_DAMAGES[damage](shard.read_bytes()))
    read = []
    real_safe_open = hidden_cache.safe_open
    with pytest.MonkeyPatch.context() as patch:  # which files training memory-maps
        patch.setattr(hidden_cache, "safe_open", lambda path, *a: (read.append(path), real_safe_open(path, *a))[1])
        with pytest.raises(UserError) as error:
            _, data = cached_data(recipe_for(llama_dir, data_file, folder))
            read_every_row(data)
    assert f"data.cache_dir={folder}: shard {shard.name} is " in one_line(error) and "overwrite=true" in str(error.value)
    assert str(shard) not in read


@pytest.mark.parametrize("damage", ["missing", "cut_in_half", "index"])
def test_check_cache_finds_what_it_can_without_the_target(llama_dir, data_file, cache, tmp_path, damage):  # noqa: F811
    """What training checks before the target loads: the index and every shard's size."""
    folder = copy_of(cache, tmp_path)
    recipe = recipe_for(llama_dir, data_file, folder)
    hidden_cache.check_cache(recipe.data)
    shard = folder / shard_names(folder)[-1]
    if damage == "missing":
        shard.unlink()
    elif damage == "cut_in_half":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:
        (folder / "index.json").write_text("{")
    with pytest.raises(UserError) as error:
        hidden_cache.check_cache(recipe.data)
    assert f"data.cache_dir={folder}" in one_line(error)


def test_the_undamaged_copy_reads_every_row(llama_dir, data_file, cache, tmp_path):  # noqa: F811
    """The control: the same reads of the copy the damages start from."""
    _, data = cached_data(recipe_for(llama_dir, data_file, copy_of(cache, tmp_path)))
    read_every_row(data)


def test_verifying_a_shard_costs_one_pass_over_its_bytes(tmp_path):
    """What the first read of a shard adds: sha256 at about 1.7 GiB/s on one core here (measured, not asserted
    tightly: the machine is shared)."""
    data = torch.randn((256 << 20) // 4)  # 256 MiB
    written = hidden_cache.save_shard({"hidden": data}, tmp_path / "s.safetensors")
    start = time.perf_counter()
    assert hidden_cache.shard_problem(tmp_path / "s.safetensors", written) is None
    seconds_per_gib = (time.perf_counter() - start) * (1 << 30) / written["bytes"]
    print(f"shard check: {seconds_per_gib:.2f} s per GiB")
    assert seconds_per_gib < 10


def test_a_rebuild_recomputes_only_the_damaged_and_missing_shards(llama_dir, data_file, cache, tmp_path,  # noqa: F811
                                                                   monkeypatch, capsys):
    folder = copy_of(cache, tmp_path)
    names = shard_names(folder)
    (folder / names[1]).write_bytes(flip_bytes((folder / names[1]).read_bytes(), 3000))
    (folder / names[4]).unlink()
    monkeypatch.setattr(hidden_cache, "SHARD_BYTES", ROWS_PER_SHARD * (len(LAYER_IDS) + 1) * SEQ_LEN * 32 * 2)
    save, written = hidden_cache.save_shard, []
    monkeypatch.setattr(hidden_cache, "save_shard", lambda tensors, path: (written.append(path.name), save(tensors, path))[1])
    hidden_cache.build(recipe_for(llama_dir, data_file, folder, "overwrite=true"))
    assert sorted(written) == sorted([names[1], names[4]])
    assert f"{names[1]} is damaged (its sha256 is not the one the index records): computing it again" in capsys.readouterr().out
    same_cache(folder, cache)


def test_a_build_stopped_after_its_index_resumes_without_recomputing(llama_dir, data_file, cache, tmp_path,  # noqa: F811
                                                                    monkeypatch):
    """Stopped between writing index.json (progress.json gone) and renaming .partial into place."""
    monkeypatch.setattr(hidden_cache, "SHARD_BYTES", ROWS_PER_SHARD * (len(LAYER_IDS) + 1) * SEQ_LEN * 32 * 2)
    recipe = recipe_for(llama_dir, data_file, tmp_path / "cache")
    monkeypatch.setattr(hidden_cache, "move_into_place", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        hidden_cache.build(recipe)
    monkeypatch.undo()
    monkeypatch.setattr(hidden_cache, "SHARD_BYTES", ROWS_PER_SHARD * (len(LAYER_IDS) + 1) * SEQ_LEN * 32 * 2)
    save, written = hidden_cache.save_shard, []
    monkeypatch.setattr(hidden_cache, "save_shard", lambda tensors, path: (written.append(path.name), save(tensors, path))[1])
    hidden_cache.build(recipe)
    assert written == []
    same_cache(tmp_path / "cache", cache)


@pytest.mark.parametrize("damage", INDEX_DAMAGES)
def test_a_broken_index_is_refused_and_a_rebuild_replaces_it(llama_dir, data_file, cache, tmp_path, damage):  # noqa: F811
    folder = copy_of(cache, tmp_path)
    (folder / "index.json").write_bytes(INDEX_DAMAGES[damage]((folder / "index.json").read_bytes()))
    with pytest.raises(UserError) as error:
        cached_data(recipe_for(llama_dir, data_file, folder))
    assert f"data.cache_dir={folder}: index.json is not a cache index" in one_line(error)
    if damage == "cut_in_half":  # the repair the line names
        hidden_cache.build(recipe_for(llama_dir, data_file, folder, "overwrite=true"))
        cached_data(recipe_for(llama_dir, data_file, folder))


@pytest.mark.parametrize("dropped", ["sha256", "layers_fingerprint"])
def test_a_cache_from_before_checksums_is_refused_asking_for_a_rebuild(llama_dir, data_file, cache, tmp_path,  # noqa: F811
                                                                      dropped):
    folder = copy_of(cache, tmp_path)
    index = json.loads((folder / "index.json").read_text())
    index.pop(dropped, None)
    for shard in index["shards"]["train"]:
        shard.pop(dropped, None)
    (folder / "index.json").write_text(json.dumps(index))
    with pytest.raises(UserError) as error:
        cached_data(recipe_for(llama_dir, data_file, folder))
    assert "was built before caches recorded their shards' checksums" in one_line(error)
    assert "overwrite=true" in str(error.value)


def saved_copy(llama_dir, out, change=None, **save_options):
    """The tiny Llama saved again into `out` (with its tokenizer), after `change(model)`."""
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    if change:
        with torch.no_grad():
            change(model)
    model.save_pretrained(out, **save_options)
    for file in llama_dir.iterdir():
        if "token" in file.name or file.name == "training.json":
            shutil.copy(file, out / file.name)
    return out


def test_a_cache_of_a_fine_tune_with_the_same_embeddings_is_refused(llama_dir, data_file, cache, tmp_path):  # noqa: F811
    def fine_tune(model):
        model.model.layers[1].mlp.down_proj.weight.mul_(1.01)

    tuned = saved_copy(llama_dir, tmp_path / "tuned", fine_tune)
    heads = [FrozenTarget.load(TargetConfig(name_or_path=str(d), layer_ids=LAYER_IDS), layers=False)
             for d in (llama_dir, tuned)]
    assert heads[0].fingerprint() == heads[1].fingerprint()  # what the cache was told apart by alone before
    with pytest.raises(UserError) as error:
        cached_data(recipe_for(tuned, data_file, cache))
    built = json.loads((cache / "index.json").read_text())["layers_fingerprint"]
    assert f"was built for layers_fingerprint {built}" in one_line(error)


def test_the_same_weights_saved_again_in_shards_keep_their_cache(llama_dir, data_file, cache, tmp_path):  # noqa: F811
    again = saved_copy(llama_dir, tmp_path / "again", max_shard_size="20KB")
    assert len(list(again.glob("*.safetensors"))) > 1
    assert hidden_cache.layers_fingerprint(TargetConfig(name_or_path=str(again))) == \
        json.loads((cache / "index.json").read_text())["layers_fingerprint"]
    cached_data(recipe_for(again, data_file, cache))


KILLED_WRITE = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from common import files
    def stalled_fsync(fd):  # the new bytes are in the temporary file, not yet in place
        print("writing", flush=True)
        time.sleep(60)
    os.fsync = stalled_fsync
    files.write_atomically(Path(sys.argv[1]), b"new" * 100000)
""")


def test_a_kill_during_a_write_leaves_the_file_as_it_was(tmp_path):
    index = tmp_path / "index.json"
    index.write_text('{"old": true}')
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITE, str(index)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert writer.stdout.readline() == "writing\n"
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        writer.kill()
    assert index.read_text() == '{"old": true}'
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name]  # what remove_unused clears in .partial


def test_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "progress.json"
    path.write_text("old")
    monkeypatch.setattr(files.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(UserError, match="cannot write .*progress.json: No space left"):
        files.write_atomically(path, b"new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["progress.json"]


def test_train_cli_refuses_a_flipped_shard_in_one_line(llama_dir, data_file, cache, tmp_path):  # noqa: F811
    """Found at a shard's first read, inside the training loop: still one line, and no step trained on it."""
    from test_cli import run_train
    from test_reliability import one_line_error

    folder = copy_of(cache, tmp_path)
    for name in shard_names(folder):  # every train shard: the first batch reads one
        shard = folder / name
        shard.write_bytes(flip_bytes(shard.read_bytes(), len(shard.read_bytes()) // 2))
    run_dir = tmp_path / "run"
    args = ["conf=eagle3_pycode", "data=text", f"data.path={data_file}", f"data.seq_len={SEQ_LEN}", "data.batch_size=2",
            "data.max_val_sequences=4", "data.hidden_states=cache", f"data.cache_dir={folder}",
            f"target.name_or_path={llama_dir}", "target.layer_ids=[" + ",".join(map(str, LAYER_IDS)) + "]",
            "trainer.num_threads=1", "logger=none", "trainer.max_steps=2", "drafter.depth=2",
            "drafter.draft_vocab_size=64", "serve_eval.every_n_steps=0", "trainer.progress_bar=false",
            f"hydra.run.dir={run_dir}"]
    result = run_train(args, cwd=tmp_path, timeout=600)
    assert "is damaged (its sha256 is not the one the index records)" in one_line_error(result.returncode, result.stderr)
    assert not list(run_dir.glob("checkpoints/*.ckpt")) and not (run_dir / "export").exists()
