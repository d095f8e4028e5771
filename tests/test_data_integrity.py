"""Damaged data files are refused in one line naming the file and where, the same way for training data
(train/data.py) and eval files (inference/evalsets.py), and before the target loads wherever that can be."""

import gzip
import json
import os
import types

import pyarrow
import pyarrow.parquet
import pytest
from test_corrupt import TRUNCATIONS
from test_hidden_cache import recipe_for
from test_regenerate import config as regenerate_config

from common.config import UserError
from inference import evalsets
from inference.evalsets import EvalConfig
from speculators.target import TargetConfig
from train import hidden_cache, regenerate
from train.data import DataConfig, check_context, read_examples

GOOD = [{"text": "plain"}, {"text": "héllo, 日本語 ✓"}, {"text": "the end"}]  # UTF-8 beyond ASCII reads as it is
LATIN1 = "caf\u00e9".encode("latin-1")  # b"caf\xe9": what a file saved in another encoding holds


def lines_with_bad_bytes(bad_lines=(2,), count=4) -> bytes:
    """JSON Lines whose lines `bad_lines` (1-based) hold a Latin-1 byte, the rest good UTF-8."""
    lines = []
    for n in range(1, count + 1):
        text = json.dumps({"text": f"row {n} ü"}, ensure_ascii=False).encode()
        lines.append(text.replace("ü".encode(), LATIN1) if n in bad_lines else text)
    return b"\n".join(lines) + b"\n"


def one_line(error) -> str:
    assert "\n" not in str(error.value)
    return str(error.value)


@pytest.mark.parametrize("name", ["docs.jsonl", "docs.jsonl.gz", "docs.json", "folder/part-00000.jsonl"])
def test_non_utf8_training_data_is_refused_naming_the_line_and_byte(tmp_path, name):
    data = lines_with_bad_bytes()
    if name.endswith(".json"):
        data = b"[" + data.replace(b"}\n{", b"},\n{").rstrip(b"\n") + b"]"
    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    source = path.parent if name.startswith("folder") else path
    with pytest.raises(UserError) as error:
        read_examples(DataConfig(source="file", path=str(source)))
    byte = data.index(b"\xe9")
    assert f"data.path={path}: 1 line(s) are not UTF-8: line 2 (byte {byte}: " in one_line(error)
    assert "re-encode the file as UTF-8" in str(error.value)


def test_every_bad_line_is_counted_and_the_first_named(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(lines_with_bad_bytes(bad_lines=range(2, 10), count=12))
    with pytest.raises(UserError, match=r"8 line\(s\) are not UTF-8: line 2 .*line 6 \(byte \d+: b'\\xe9"):
        read_examples(DataConfig(source="file", path=str(path)))
    with pytest.raises(UserError, match="; and 3 more; re-encode"):
        read_examples(DataConfig(source="file", path=str(path)))


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_the_same_bytes_in_an_eval_file_are_refused_the_same_way(tmp_path, suffix):
    path = tmp_path / f"prompts{suffix}"
    body = [json.dumps("first"), b'"caf\xe9"'.decode("latin-1"), json.dumps("third")]
    text = "\n".join(body) if suffix == ".jsonl" else "[" + ",\n".join(body) + "]"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(UserError) as error:
        evalsets.conversations(EvalConfig("file", path=str(path)))
    assert f"eval.path={path}: 1 line(s) are not UTF-8: line 2 (byte " in one_line(error)


def test_utf8_beyond_ascii_reads_unchanged_in_both(tmp_path):
    """The control: the policy refuses bytes that are not UTF-8, never characters that are."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in GOOD), encoding="utf-8")
    assert list(read_examples(DataConfig(source="file", path=str(path)))) == GOOD
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row["text"], ensure_ascii=False) + "\n" for row in GOOD), encoding="utf-8")
    assert evalsets.conversations(EvalConfig("file", path=str(prompts), num_prompts=3)) == [[r["text"]] for r in GOOD]


@pytest.fixture(scope="module")
def parquet_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("parquet") / "docs.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"text": [f"document {i} " * 20 for i in range(400)]}), path,
                                row_group_size=50)
    return path.read_bytes()


@pytest.mark.parametrize("damage", TRUNCATIONS)
@pytest.mark.parametrize("folder", [False, True])
def test_a_truncated_or_damaged_parquet_is_refused_by_name(parquet_bytes, tmp_path, damage, folder):
    path = tmp_path / "docs.parquet"
    path.write_bytes(TRUNCATIONS[damage](parquet_bytes))
    with pytest.raises(UserError) as error:
        read_examples(DataConfig(source="file", path=str(tmp_path if folder else path)))
    assert f"data.path={path}: not a readable parquet file (" in one_line(error)


def test_the_undamaged_parquet_loads(parquet_bytes, tmp_path):
    path = tmp_path / "docs.parquet"
    path.write_bytes(parquet_bytes)
    assert len(read_examples(DataConfig(source="file", path=str(path)))) == 400


def test_a_seq_len_over_the_targets_context_is_refused_from_its_config(llama_dir):
    target = TargetConfig(name_or_path=str(llama_dir))  # max_position_embeddings 256
    check_context(DataConfig(seq_len=256), target)
    with pytest.raises(UserError) as error:
        check_context(DataConfig(seq_len=257), target)
    assert f"data.seq_len=257 is over target {llama_dir}'s context of 256 positions" in one_line(error)


@pytest.fixture
def no_target(monkeypatch):
    """Loading a target fails the test: what it checks must be refused before."""
    def load(*args, **kwargs):
        raise AssertionError("the target was loaded before the data was checked")

    for module in (hidden_cache, regenerate):
        monkeypatch.setattr(module.FrozenTarget, "load", load)


def test_a_cache_build_checks_its_data_and_seq_len_before_the_target_loads(llama_dir, tmp_path, no_target):
    bad = tmp_path / "docs.jsonl"
    bad.write_bytes(lines_with_bad_bytes())
    with pytest.raises(UserError, match="line 2 .* not UTF-8|not UTF-8: line 2"):
        hidden_cache.build(recipe_for(llama_dir, bad, tmp_path / "cache"))
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(UserError, match="data.seq_len=512 is over target"):
        hidden_cache.build(recipe_for(llama_dir, good, tmp_path / "cache", "data.seq_len=512"))
    assert not (tmp_path / "cache").exists() and not (tmp_path / "cache.partial").exists()


def test_regeneration_checks_its_data_before_the_target_loads(llama_dir, tmp_path, no_target):
    bad = tmp_path / "chats.jsonl"
    bad.write_bytes(b'{"conversations": [{"from": "human", "value": "caf\xe9"}]}\n')
    with pytest.raises(UserError, match=f"data.path={bad}: 1 line\\(s\\) are not UTF-8: line 1"):
        regenerate.regenerate(regenerate_config(llama_dir, bad, tmp_path / "out"))


def test_a_regenerated_shard_is_compressed_atomically(tmp_path, monkeypatch):
    """A failure while the compressed shard is written (a full disk) is one line and leaves the plain shard as it
    was."""
    opened = tmp_path / "part-00000.jsonl"
    opened.write_text('{"a": 1}\n')
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(UserError, match="cannot write .*part-00000.jsonl.gz: No space left on device"):
        regenerate.close_shard(opened)
    assert opened.read_text() == '{"a": 1}\n' and [p.name for p in tmp_path.iterdir()] == [opened.name]


@pytest.mark.parametrize("damage", TRUNCATIONS)
def test_a_damaged_regeneration_meta_json_is_one_line(llama_dir, tmp_path, damage):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    shards = regenerate.Shards(tmp_path / "out", 4)
    shards.folder.mkdir()
    shards.meta.write_bytes(TRUNCATIONS[damage](json.dumps({"seed": 0}).encode()))
    target = types.SimpleNamespace(name_or_path=str(llama_dir), fingerprint=lambda: "f")
    with pytest.raises(UserError) as error:
        regenerate.resume(regenerate_config(llama_dir, chats, shards.folder), target, shards)
    assert f"{shards.meta} is damaged" in one_line(error)
