"""train.data: the path-hash split, the stdlib corpus walk, packing, and exact resume of the stream."""

import itertools
from collections import Counter

import datasets
import pytest
import torch

from common.config import UserError
from common.corpus import SPLITS, split_of, stdlib_files
from train.data import EndlessShuffle, pack
from train.pretrain import EOS, train_tokenizer


def names_in(split: str, count: int, folder: str = "") -> list[str]:
    """Relative paths (under `folder`) that the path hash sends to `split`."""
    candidates = (f"{folder}m{i}.py" for i in itertools.count())
    return list(itertools.islice((p for p in candidates if split_of(p) == split), count))


def write(root, relpaths, text="x = 1\n"):
    for rel in relpaths:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_split_of_is_deterministic_and_roughly_90_5_5():
    paths = [f"pkg{i % 37}/module_{i}.py" for i in range(20_000)]
    assert [split_of(p) for p in paths] == [split_of(p) for p in paths]
    counts = Counter(split_of(p) for p in paths)
    assert set(counts) == set(SPLITS)
    for split, share in {"train": 0.90, "validation": 0.05, "test": 0.05}.items():
        assert abs(counts[split] / len(paths) - share) < 0.01, counts


def test_no_python_files_is_a_clear_user_error(tmp_path):
    (tmp_path / "README.txt").write_text("not python")
    write(tmp_path, ["blank.py"], text="  \n")  # an empty file is not a file of the corpus
    with pytest.raises(UserError, match=r"no \.py files found under"):
        stdlib_files(str(tmp_path))


def test_missing_stdlib_path_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="not a directory"):
        stdlib_files(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("present, empty", [(["train"], "validation"), (["train", "validation"], "test")])
def test_an_empty_split_is_named(tmp_path, present, empty):
    write(tmp_path, [p for split in present for p in names_in(split, 3)])
    with pytest.raises(UserError, match=f"the {empty} split of .* is empty"):
        stdlib_files(str(tmp_path))


def test_site_packages_and_test_folders_are_excluded(tmp_path):
    kept = [p for split in SPLITS for p in names_in(split, 2)] + names_in("train", 1, "email/mime/")
    tests = ["test/test_os.py", "unittest/tests/test_case.py", "idlelib/idle_test/test_run.py"]
    installed = ["site-packages/pkg/mod.py", "dist-packages/mod.py", "site-packages/pkg/tests/test_mod.py"]
    write(tmp_path, kept + tests + installed)

    def walked(**kw):
        files = stdlib_files(str(tmp_path), **kw)
        for split in SPLITS:  # every file sits in the split its path hashes to
            assert all(split_of(p) == split for p in files[split]["path"])
        return {p for split in SPLITS for p in files[split]["path"]}

    assert walked() == set(kept)
    assert walked(include_tests=True) == set(kept) | set(tests)  # site-packages stays out regardless


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["def f(x):\n    return x + 1\n", "class A:\n    pass\n"] * 10, vocab_size=270)


def test_pack_rows_of_seq_len_with_eos_after_each_file(tokenizer):
    texts = ["import os\n", "def f(x):\n    return x + 1\n" * 3, "class A:\n    pass\n" * 5]
    files = datasets.Dataset.from_dict({"path": ["a.py", "b.py", "c.py"], "text": texts})
    seq_len = 8
    rows = pack(files, tokenizer, seq_len)

    eos = tokenizer.convert_tokens_to_ids(EOS)
    stream = [t for text in texts for t in tokenizer(text)["input_ids"] + [eos]]
    assert rows.dtype == torch.long and rows.shape == (len(stream) // seq_len, seq_len)
    assert rows.flatten().tolist() == stream[: rows.numel()]  # the tail that fills no row is dropped
    ends = list(itertools.accumulate(len(tokenizer(t)["input_ids"]) + 1 for t in texts))
    assert [i for i, t in enumerate(stream) if t == eos] == [e - 1 for e in ends]  # EOS only between files
    assert tokenizer.decode(stream, skip_special_tokens=False).split(EOS)[:-1] == texts

    with pytest.raises(UserError, match="do not fill one sequence"):
        pack(files, tokenizer, len(stream) + 1)


def take(dataset, n: int) -> list[list[int]]:
    return [item["input_ids"].tolist() for item in itertools.islice(iter(dataset), n)]


@pytest.mark.parametrize("skip", [0, 1, 6, 7, 8, 15, 23])  # within, at and across epoch boundaries of 7 rows
def test_endless_shuffle_resumed_with_skip_continues_the_same_stream(skip):
    rows = torch.arange(7 * 3).view(7, 3)
    fresh = take(EndlessShuffle(rows, rows > 3, seed=5), skip + 20)
    assert take(EndlessShuffle(rows, rows > 3, seed=5, skip=skip), 20) == fresh[skip:]


def test_endless_shuffle_visits_every_row_once_per_epoch_in_new_orders():
    rows = torch.arange(7 * 3).view(7, 3)
    stream = take(EndlessShuffle(rows, rows > 3, seed=5), 21)
    epochs = [stream[i : i + 7] for i in range(0, 21, 7)]
    assert all(sorted(epoch) == rows.tolist() for epoch in epochs)
    assert len({tuple(map(tuple, epoch)) for epoch in epochs}) > 1  # reshuffled, not one order repeated
    assert take(EndlessShuffle(rows, rows > 3, seed=6), 7) != epochs[0]  # the seed matters


def test_endless_shuffle_keeps_each_rows_mask():
    rows = torch.arange(7 * 3).view(7, 3)
    for item in itertools.islice(iter(EndlessShuffle(rows, rows % 2 == 0, seed=5)), 20):
        assert torch.equal(item["loss_mask"], item["input_ids"] % 2 == 0)


@pytest.mark.parametrize("skip", [0, 4, 9])
def test_endless_shuffle_shards_each_global_batch_disjointly_across_processes(skip):
    """Two processes with batch 2 see, batch for batch, the rows one process sees with batch 4."""
    rows = torch.arange(7 * 3).view(7, 3)
    single = take(EndlessShuffle(rows, rows > 3, seed=5, skip=skip), 24)
    shards = [take(EndlessShuffle(rows, rows > 3, seed=5, skip=skip, rank=r, world_size=2), 12) for r in (0, 1)]
    for b in range(6):
        local = [shards[r][2 * b : 2 * b + 2] for r in (0, 1)]
        assert sorted(local[0] + local[1]) == sorted(single[4 * b : 4 * b + 4])
    assert [row for pair in zip(*shards) for row in pair] == single  # disjoint: rank r takes rows r, r + 2, ...
