"""The draft vocabulary: top-N tokens sorted by id, d2t = target_id - draft_id (int64), t2d a bool mask."""

import pytest
import torch

from common.config import UserError
from speculators import draft_vocab


def expected_kept(counts: list[int], n: int) -> list[int]:
    """Reference: the n most frequent ids (ties to the lower id), listed by increasing id."""
    by_rank = sorted(range(len(counts)), key=lambda i: (-counts[i], i))
    return sorted(by_rank[:n])


def test_build_keeps_top_n_by_frequency_sorted_by_id():
    counts = [5, 100, 0, 7, 60, 3, 80, 1, 9, 2]
    d2t, t2d = draft_vocab.build(torch.tensor(counts), 4)
    kept = draft_vocab.target_ids(d2t).tolist()
    assert kept == [1, 4, 6, 8]  # counts 100, 60, 80, 9
    assert kept == expected_kept(counts, 4)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("size", [1, 17, 200, 256])
def test_build_random_counts_match_reference(seed, size):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 50, (256,), generator=g)  # many ties
    d2t, t2d = draft_vocab.build(counts, size)
    assert draft_vocab.target_ids(d2t).tolist() == expected_kept(counts.tolist(), size)


def test_maps_dtypes_lengths_and_round_trip():
    counts = torch.tensor([3, 0, 9, 9, 1, 0, 4, 12, 2, 0, 5, 7])
    V, N = len(counts), 5
    d2t, t2d = draft_vocab.build(counts, N)
    assert d2t.dtype == torch.int64 and d2t.shape == (N,)
    assert t2d.dtype == torch.bool and t2d.shape == (V,)
    kept = expected_kept(counts.tolist(), N)
    assert kept == [2, 3, 7, 10, 11]  # counts 9, 9, 12, 5, 7
    assert sorted(counts[kept].tolist(), reverse=True) == sorted(counts.tolist(), reverse=True)[:N]
    # d2t[i] = target_id(i) - i, so target_id = i + d2t[i].
    assert d2t.tolist() == [t - i for i, t in enumerate(kept)]
    assert draft_vocab.target_ids(d2t).tolist() == kept
    # t2d marks exactly the kept ids.
    assert torch.nonzero(t2d).flatten().tolist() == kept
    assert int(t2d.sum()) == N
    draft_vocab.check(d2t, t2d, V, N)  # its own output passes the check


def test_ties_go_to_lower_ids_and_are_deterministic():
    counts = torch.full((50,), 7)
    counts[[10, 40]] = 9
    d2t, t2d = draft_vocab.build(counts, 6)
    assert draft_vocab.target_ids(d2t).tolist() == [0, 1, 2, 3, 10, 40]
    # Same answer every time, and the same for a copy of the counts in a different dtype.
    for _ in range(3):
        again_d2t, again_t2d = draft_vocab.build(counts.clone(), 6)
        assert torch.equal(again_d2t, d2t) and torch.equal(again_t2d, t2d)
    d2t_i32, _ = draft_vocab.build(counts.to(torch.int32), 6)
    assert torch.equal(d2t_i32, d2t)


def test_all_tokens_kept_is_identity():
    d2t, t2d = draft_vocab.build(torch.tensor([4, 1, 0, 9]), 4)
    assert d2t.tolist() == [0, 0, 0, 0]
    assert t2d.all()


@pytest.mark.parametrize("size", [65, 1000])
def test_draft_vocab_larger_than_target_is_a_user_error(size):
    with pytest.raises(UserError) as e:
        draft_vocab.build(torch.ones(64, dtype=torch.long), size)
    msg = str(e.value)
    assert "draft_vocab_size" in msg and str(size) in msg and "64" in msg


def test_empty_draft_vocab_is_a_user_error():
    with pytest.raises(UserError, match="draft_vocab_size"):
        draft_vocab.build(torch.ones(64, dtype=torch.long), 0)


def test_count_tokens_counts_only_loss_masked_positions():
    ids = torch.tensor([[1, 2, 2, 3], [3, 3, 0, 1]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 0]])
    counts = draft_vocab.count_tokens(ids, mask, 6)
    assert counts.tolist() == [1, 0, 2, 2, 0, 0]


# --- check(): refuse maps that would silently break serving -------------------------------------


@pytest.fixture
def maps():
    counts = torch.arange(40) % 13  # V = 40
    d2t, t2d = draft_vocab.build(counts, 10)
    return d2t, t2d


def test_check_accepts_valid_maps(maps):
    d2t, t2d = maps
    draft_vocab.check(d2t, t2d, 40, 10)


@pytest.mark.parametrize("which", ["d2t", "t2d", "both"])
def test_check_refuses_missing_maps(maps, which):
    d2t, t2d = maps
    args = (None if which in ("d2t", "both") else d2t, None if which in ("t2d", "both") else t2d)
    with pytest.raises(UserError, match="d2t"):
        draft_vocab.check(*args, 40, 10)


@pytest.mark.parametrize("d2t_dtype,t2d_dtype", [(torch.int32, torch.bool), (torch.float32, torch.bool),
                                                 (torch.int64, torch.uint8), (torch.int64, torch.int64)])
def test_check_refuses_wrong_dtypes(maps, d2t_dtype, t2d_dtype):
    d2t, t2d = maps
    with pytest.raises(UserError, match="int64"):
        draft_vocab.check(d2t.to(d2t_dtype), t2d.to(t2d_dtype), 40, 10)


def test_check_refuses_wrong_lengths(maps):
    d2t, t2d = maps
    with pytest.raises(UserError, match="entries"):
        draft_vocab.check(d2t[:-1], t2d, 40, 10)  # d2t shorter than the draft vocab
    with pytest.raises(UserError, match="entries"):
        draft_vocab.check(d2t, t2d, 40, 11)  # config says 11 draft tokens
    with pytest.raises(UserError, match="entries"):
        draft_vocab.check(d2t, torch.cat([t2d, torch.zeros(1, dtype=torch.bool)]), 40, 10)  # t2d too long
    with pytest.raises(UserError, match="entries"):
        draft_vocab.check(d2t, t2d, 41, 10)  # target vocab differs from t2d's length


def test_check_refuses_t2d_marking_other_ids(maps):
    d2t, t2d = maps
    kept = draft_vocab.target_ids(d2t)
    bad = t2d.clone()
    unkept = int(torch.nonzero(~t2d)[0])
    bad[kept[3]], bad[unkept] = False, True  # same count, one id swapped
    with pytest.raises(UserError, match="t2d"):
        draft_vocab.check(d2t, bad, 40, 10)
    extra = t2d.clone()
    extra[unkept] = True  # one id too many
    with pytest.raises(UserError, match="t2d"):
        draft_vocab.check(d2t, extra, 40, 10)


def test_check_refuses_all_zero_d2t_with_a_real_t2d(maps):
    """The classic serving failure: d2t left at zeros (identity) while the vocab is reduced."""
    _, t2d = maps
    with pytest.raises(UserError):
        draft_vocab.check(torch.zeros(10, dtype=torch.int64), t2d, 40, 10)


def test_check_refuses_non_increasing_or_out_of_range_ids(maps):
    d2t, t2d = maps
    dup = d2t.clone()
    dup[5] = dup[4] - 1  # draft ids 4 and 5 map to the same target id
    with pytest.raises(UserError, match="increasing"):
        draft_vocab.check(dup, t2d, 40, 10)
    too_high = d2t.clone()
    too_high[-1] = 40 - 9  # target id 40 == V
    with pytest.raises(UserError, match="inside the target vocabulary"):
        draft_vocab.check(too_high, t2d, 40, 10)
    negative = d2t.clone()
    negative[0] = -1
    with pytest.raises(UserError, match="inside the target vocabulary"):
        draft_vocab.check(negative, t2d, 40, 10)
