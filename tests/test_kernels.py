"""kernels/: each kernel against its plain-torch reference, on the CPU.

The Triton kernels run in Triton's interpreter, which needs TRITON_INTERPRET=1 before triton is
imported (conftest's transformers import pulls it in), so `test_triton_kernels_in_the_interpreter`
reruns this file in a child process started with it, where the `interpreted` tests run too.
`TRITON_INTERPRET=1 python -m pytest tests/test_kernels.py` runs them directly, case by case.

Shapes are small and random: ragged vocabularies (not multiples of the 16-column blocks the
tests use, so a row takes several blocks, the last one partial), masked positions, shifted
targets, bf16/fp16 inputs, strided views. Tolerances (every implementation computes in fp32;
they differ only in summation order):
- loss: atol 2e-5, rtol 1e-5;
- gradient: atol 2e-6, rtol 1e-5 in fp32; bf16 and fp16 gradients within one unit in the last
  place of their dtype (the interpreter truncates fp32 -> bf16 where compiled Triton rounds);
- verification: accepted lengths and tokens equal exactly.
"""

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import forge_kernels as kernels
from forge_kernels import (
    distill_loss,
    distill_loss_chunked,
    distill_loss_reference,
    distill_loss_triton,
    verify_greedy,
    verify_greedy_reference,
    verify_greedy_triton,
    verify_sampling,
    verify_sampling_reference,
    verify_sampling_triton,
)

LOSS_TOL = dict(atol=2e-5, rtol=1e-5)
GRAD_TOL = {torch.float32: dict(atol=2e-6, rtol=1e-5), torch.bfloat16: dict(atol=1e-6, rtol=2**-7),
            torch.float16: dict(atol=1e-6, rtol=2**-10)}
BLOCK = 16  # vocabulary columns per kernel step in the tests
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

interpreted = pytest.mark.skipif(not kernels.INTERPRET, reason="needs TRITON_INTERPRET=1 at start-up; "
                                 "test_triton_kernels_in_the_interpreter runs it in a child process")


def test_triton_kernels_in_the_interpreter():
    if kernels.INTERPRET:
        pytest.skip("this process interprets Triton itself")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", __file__],
                           env=env, cwd=Path(__file__).parent.parent, capture_output=True, text=True)
    summary = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else ""
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    # Only this test may skip there: anything else means the child did not interpret Triton.
    assert re.search(r"\d+ passed, 1 skipped", summary), summary


# --- distillation loss -------------------------------------------------------------------------


def loss_case(seed: int):
    """Random inputs: (draft_logits, target_logits, draft_to_target, mask, kind, shift)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = rng.choice([None, 1, 2, 3])  # None: 2-D inputs [T, vocab]
    T, D = rng.randint(1, 9), rng.choice([1, 5, 16, 37, 50, 129])
    V = D + rng.randint(0, 60)
    lead = (T,) if batch is None else (batch, T)
    z = torch.randn(*lead, D, generator=gen).mul_(3).to(rng.choice(DTYPES))
    if rng.random() < 0.5:
        z = z.transpose(-1, -2).contiguous().transpose(-1, -2)  # columns strided, rows not
    t = torch.randn(*lead, V + 7, generator=gen).mul_(3).to(rng.choice(DTYPES))[..., 3:V + 3]  # a view
    draft_to_target = torch.randperm(V, generator=gen)[:D].sort().values
    mask = torch.rand(*lead, generator=gen) < 0.7
    return z, t, draft_to_target, mask, rng.choice(["soft_ce", "kl"]), rng.randint(0, T)


def loss_and_grad(fn, z, t, draft_to_target, mask, kind, shift, weights, **kw):
    """The loss and d(sum(weights * loss)) / d draft_logits."""
    z = z.detach().requires_grad_()
    loss = fn(z, t, draft_to_target, mask, kind=kind, shift=shift, **kw)
    (loss * weights).sum().backward()
    return loss.detach(), z.grad


@pytest.mark.parametrize("impl", ["chunked", pytest.param("triton", marks=interpreted)])
@pytest.mark.parametrize("seed", range(24))
def test_distill_loss_matches_reference(seed, impl):
    z, t, draft_to_target, mask, kind, shift = loss_case(seed)
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed))
    expected, expected_grad = loss_and_grad(distill_loss_reference, z, t, draft_to_target, mask, kind, shift, weights)
    if impl == "chunked":
        fn, kw = distill_loss_chunked, dict(chunk=random.Random(seed).randint(1, 4))
    else:
        fn, kw = distill_loss_triton, dict(block=BLOCK)
    loss, grad = loss_and_grad(fn, z, t, draft_to_target, mask, kind, shift, weights, **kw)
    assert loss.dtype == torch.float32 and grad.dtype == z.dtype
    torch.testing.assert_close(loss, expected, **LOSS_TOL)
    torch.testing.assert_close(grad, expected_grad, **GRAD_TOL[z.dtype])
    T = mask.shape[-1]
    no_target = torch.arange(T) >= T - shift
    assert bool((loss[~mask] == 0).all()) and bool((loss[..., no_target] == 0).all())
    assert bool((grad[~mask] == 0).all()) and bool((grad[..., no_target, :] == 0).all())


def test_distill_loss_reference_is_the_eagle3_loss_and_kl():
    """soft CE as speculators.eagle3 computes it (shift_left of the target's draft-vocab
    softmax), and KL = soft CE - entropy of p."""
    from speculators.layers import shift_left

    gen = torch.Generator().manual_seed(0)
    B, T, D, V, shift = 2, 8, 11, 30, 2
    z, t = torch.randn(B, T, D, generator=gen), torch.randn(B, T, V, generator=gen)
    draft_to_target = torch.randperm(V, generator=gen)[:D].sort().values
    mask = torch.ones(B, T, dtype=torch.bool)
    p = torch.softmax(t[..., draft_to_target], dim=-1)
    soft_ce = -(shift_left(p, shift) * torch.log_softmax(z, dim=-1)).sum(-1)
    soft_ce_ref = distill_loss_reference(z, t, draft_to_target, mask, kind="soft_ce", shift=shift)
    torch.testing.assert_close(soft_ce_ref, soft_ce)
    entropy = -(p * p.log()).sum(-1)
    kl = distill_loss_reference(z, t, draft_to_target, mask, kind="kl", shift=shift)
    torch.testing.assert_close(kl, soft_ce - shift_left(entropy, shift))


def test_lk_losses_are_the_acceptance_rate():
    """alpha = sum min(p, q) = 1 - TV(p, q): lk = -log alpha, lk_hybrid = w KL + (1 - w)(1 - alpha) with
    w = exp(-3 alpha); both vanish where the draft equals the target."""
    gen = torch.Generator().manual_seed(0)
    B, T, D, V, shift = 2, 6, 13, 40, 1
    z, t = torch.randn(B, T, D, generator=gen), torch.randn(B, T, V, generator=gen)
    draft_to_target = torch.randperm(V, generator=gen)[:D].sort().values
    mask = torch.ones(B, T, dtype=torch.bool)
    p = torch.softmax(t[..., shift:, :][..., draft_to_target], -1)
    q = torch.softmax(z[..., :-shift, :], -1)
    alpha = 1 - 0.5 * (p - q).abs().sum(-1)
    lk = distill_loss(z, t, draft_to_target, mask, kind="lk", shift=shift)
    torch.testing.assert_close(lk[..., :-shift], -alpha.log())
    kl = distill_loss_reference(z, t, draft_to_target, mask, kind="kl", shift=shift)[..., :-shift]
    w = torch.exp(-3 * alpha)
    hybrid = distill_loss(z, t, draft_to_target, mask, kind="lk_hybrid", shift=shift)
    torch.testing.assert_close(hybrid[..., :-shift], w * kl + (1 - w) * (1 - alpha))
    same = torch.zeros(B, T, V)
    same[..., draft_to_target] = z
    for kind in ("lk", "lk_hybrid"):
        assert distill_loss(z, same, draft_to_target, mask, kind=kind).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["lk", "lk_hybrid"])
def test_lk_training_raises_acceptance_and_ignores_padding(kind):
    """A few gradient steps on the LK loss raise sum min(p, q); garbage in masked positions neither
    reaches the loss nor the gradient."""
    gen = torch.Generator().manual_seed(1)
    z, t = torch.randn(2, 5, 20, generator=gen), torch.randn(2, 5, 40, generator=gen) * 3
    draft_to_target = torch.arange(0, 40, 2)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    z[~mask], t[~mask] = float("nan"), float("inf")
    z.requires_grad_()
    optimizer = torch.optim.SGD([z], lr=1.0)

    def acceptance():
        p = torch.softmax(t[mask][:, draft_to_target], -1)
        return torch.minimum(p, torch.softmax(z.detach()[mask], -1)).sum(-1).mean()

    before = acceptance()
    for _ in range(20):
        optimizer.zero_grad()
        loss = distill_loss(z, t, draft_to_target, mask, kind=kind)
        loss.sum().backward()
        assert bool((loss[~mask] == 0).all()) and bool(z.grad.isfinite().all()) and bool((z.grad[~mask] == 0).all())
        optimizer.step()
    assert acceptance() > before + 0.1


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy (the interpreter) on the nan/inf padding
@pytest.mark.parametrize("impl", ["chunked", pytest.param("triton", marks=interpreted)])
def test_distill_loss_ignores_garbage_in_masked_positions(impl):
    """Padding may hold anything (inf, nan): masked positions still get loss 0 and gradient 0,
    the others are untouched."""
    gen = torch.Generator().manual_seed(1)
    z, t = torch.randn(2, 5, 20, generator=gen), torch.randn(2, 5, 40, generator=gen)
    draft_to_target = torch.arange(0, 40, 2)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    expected = distill_loss_reference(z, t, draft_to_target, mask, kind="kl")
    z[~mask], t[~mask] = float("nan"), float("inf")
    fn, kw = (distill_loss_chunked, {}) if impl == "chunked" else (distill_loss_triton, dict(block=BLOCK))
    loss, grad = loss_and_grad(fn, z, t, draft_to_target, mask, "kl", 0, torch.ones(2, 5), **kw)
    torch.testing.assert_close(loss, expected, **LOSS_TOL)
    assert bool((grad[~mask] == 0).all()) and bool(grad.isfinite().all())


def test_public_functions_follow_the_dispatch_rule():
    """On the CPU: Triton (interpreted) under TRITON_INTERPRET=1, the torch path otherwise;
    the same answers either way."""
    assert kernels.use_triton(torch.zeros(1)) == kernels.INTERPRET
    z, t, draft_to_target, mask, _, _ = loss_case(3)
    loss, _ = loss_and_grad(distill_loss, z, t, draft_to_target, mask, "kl", 1, torch.ones(mask.shape))
    expected = distill_loss_reference(z, t, draft_to_target, mask, kind="kl", shift=1)
    torch.testing.assert_close(loss, expected, **LOSS_TOL)
    drafts, draft_probs, logits, uniform = verify_case(3)
    assert_same(verify_greedy(drafts, logits), verify_greedy_reference(drafts, logits))
    assert_same(verify_sampling(drafts, draft_probs, logits, 0.8, uniform),
                verify_sampling_reference(drafts, draft_probs, logits, 0.8, uniform))


# --- verification ------------------------------------------------------------------------------


def verify_case(seed: int):
    """Random chains: (drafts [B, K], draft_probs [B, K, V], target_logits [B, K+1, V], uniform [B, K+1]).
    Drafts are sampled from q, which leans towards the target, so chains accept 0..K tokens."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    B, K, V = rng.randint(1, 5), rng.randint(0, 5), rng.randint(1, 150)
    logits = torch.randn(B, K + 1, V, generator=gen).mul_(rng.choice([0.5, 2.0, 4.0])).to(rng.choice(DTYPES))
    q = torch.softmax(logits[:, :K].float() + torch.randn(B, K, V, generator=gen), dim=-1)
    drafts = torch.multinomial(q.view(-1, V), 1, generator=gen).view(B, K) if K else torch.zeros(B, 0, dtype=torch.long)
    return drafts, q, logits, torch.rand(B, K + 1, generator=gen)


def assert_same(got, expected):
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), (got, expected)


@pytest.mark.parametrize("seed", range(16))
def test_verify_greedy_reference_is_the_engine_rule(seed):
    from inference.engine import chain_greedy as verify_one_chain

    drafts, logits = greedy_case(seed)
    accepted, token = verify_greedy_reference(drafts, logits)
    engine = [verify_one_chain(d.tolist(), lg) for d, lg in zip(drafts, logits)]
    assert accepted.tolist() == [a for a, _ in engine] and token.tolist() == [x for _, x in engine]


def greedy_case(seed: int):
    """Drafts mostly equal to the target's argmax, some replaced, so every accepted length occurs."""
    drafts, _, logits, _ = verify_case(seed)
    keep = torch.rand(drafts.shape, generator=torch.Generator().manual_seed(seed)) < 0.8
    return torch.where(keep, logits.argmax(-1)[:, :-1], drafts), logits


@interpreted
@pytest.mark.parametrize("seed", range(16))
def test_verify_greedy_matches_reference(seed):
    drafts, logits = greedy_case(seed)
    assert_same(verify_greedy_triton(drafts, logits, block=BLOCK), verify_greedy_reference(drafts, logits))


@interpreted
@pytest.mark.parametrize("seed", range(16))
def test_verify_sampling_matches_reference(seed):
    drafts, draft_probs, logits, uniform = verify_case(seed)
    temperature = random.Random(seed).choice([0.5, 1.0, 1.7])
    expected = verify_sampling_reference(drafts, draft_probs, logits, temperature, uniform)
    assert_same(verify_sampling_triton(drafts, draft_probs, logits, temperature, uniform, block=BLOCK), expected)


def test_verify_sampling_reference_is_lossless():
    """The first emitted token (an accepted draft or the resampled one) is distributed as p:
    200k chains through the reference, every frequency within 5 standard errors."""
    gen = torch.Generator().manual_seed(0)
    B, K, V = 200_000, 2, 6
    logits = torch.randn(1, K + 1, V, generator=gen).mul_(2).expand(B, -1, -1)
    q = torch.softmax(torch.randn(1, K, V, generator=gen).mul_(2), dim=-1).expand(B, -1, -1)
    drafts = torch.multinomial(q[0], B, replacement=True, generator=gen).T
    accepted, token = verify_sampling_reference(drafts, q, logits, 1.0, torch.rand(B, K + 1, generator=gen))
    first = torch.where(accepted > 0, drafts[:, 0], token)
    p = torch.softmax(logits[0, 0], dim=-1)
    frequency = torch.bincount(first, minlength=V) / B
    assert bool(((frequency - p).abs() <= 5 * (p * (1 - p) / B).sqrt()).all()), (frequency, p)


# --- bad input ---------------------------------------------------------------------------------


def loss_inputs(**changes):
    inputs = dict(draft_logits=torch.zeros(2, 3, 4), target_logits=torch.zeros(2, 3, 9),
                  draft_to_target=torch.tensor([0, 2, 4, 8]), mask=torch.ones(2, 3, dtype=torch.bool),
                  kind="kl", shift=0)
    return {**inputs, **changes}


def verify_inputs(**changes):
    inputs = dict(drafts=torch.zeros(2, 3, dtype=torch.long), draft_probs=torch.full((2, 3, 9), 1 / 9),
                  target_logits=torch.zeros(2, 4, 9), temperature=1.0, uniform=torch.rand(2, 4))
    return {**inputs, **changes}


BAD_LOSS_INPUTS = [
    (dict(draft_logits=torch.zeros(2, 4, 4)), "positions differ"),
    (dict(target_logits=torch.zeros(3, 9)), r"both be \[T, vocab\] or \[B, T, vocab\]"),
    (dict(mask=torch.ones(2, 4, dtype=torch.bool)), "positions differ"),
    (dict(mask=torch.ones(2, 3)), "mask must be bool"),
    (dict(draft_logits=torch.zeros(2, 3, 4, dtype=torch.long)), "draft_logits must be float32"),
    (dict(target_logits=torch.zeros(2, 3, 9, dtype=torch.float64)), "target_logits must be float32"),
    (dict(draft_to_target=torch.tensor([0.0, 2.0, 4.0, 8.0])), "draft_to_target must be a 1-D int64"),
    (dict(draft_to_target=torch.tensor([0, 2, 4])), "draft_to_target has 3 entries but draft_logits has D=4"),
    (dict(draft_to_target=torch.tensor([0, 2, 4, 9])), "outside the target vocabulary 0..8"),
    (dict(kind="ce"), "kind='ce'"),
    (dict(shift=-1), "shift must be >= 0"),
]
BAD_VERIFY_INPUTS = [  # the first four apply to greedy verification too
    (dict(drafts=torch.zeros(2, 3)), r"drafts must be a \[B, K\] int64"),
    (dict(drafts=torch.zeros(2, 2, dtype=torch.long)), r"target_logits must be \[B, K\+1, V\] = \[2, 3, V\]"),
    (dict(target_logits=torch.zeros(2, 4, 9, dtype=torch.long)), "target_logits must be float32"),
    (dict(drafts=torch.full((2, 3), 9)), "outside the target vocabulary 0..8"),
    (dict(draft_probs=torch.zeros(2, 3, 8)), r"draft_probs must be \[B, K, V\] = \[2, 3, 9\]"),
    (dict(uniform=torch.rand(2, 3)), r"uniform must be \[B, K\+1\] = \[2, 4\]"),
    (dict(uniform=torch.rand(2, 4).bfloat16()), "uniform must be float32"),
    (dict(temperature=0.0), "temperature must be > 0"),
]


@pytest.mark.parametrize("changes,message", BAD_LOSS_INPUTS)
@pytest.mark.parametrize("fn", [distill_loss, distill_loss_reference, distill_loss_chunked, distill_loss_triton])
def test_distill_loss_rejects_bad_input(fn, changes, message):
    with pytest.raises(ValueError, match=message):
        fn(**loss_inputs(**changes))


@pytest.mark.parametrize("changes,message", BAD_VERIFY_INPUTS)
@pytest.mark.parametrize("fn", [verify_sampling, verify_sampling_reference, verify_sampling_triton])
def test_verify_sampling_rejects_bad_input(fn, changes, message):
    with pytest.raises(ValueError, match=message):
        fn(**verify_inputs(**changes))


@pytest.mark.parametrize("changes,message", BAD_VERIFY_INPUTS[:4])
@pytest.mark.parametrize("fn", [verify_greedy, verify_greedy_reference, verify_greedy_triton])
def test_verify_greedy_rejects_bad_input(fn, changes, message):
    inputs = verify_inputs(**changes)
    with pytest.raises(ValueError, match=message):
        fn(inputs["drafts"], inputs["target_logits"])


def test_relaxed_verification_accepts_near_argmax_drafts_and_is_greedy_at_zero():
    """Typical acceptance: draft i passes when p_i(x_i) >= (1 - t) max p_i; t = 0 is the greedy rule."""
    torch.manual_seed(0)
    logits = torch.randn(64, 5, 50) * 3
    drafts = torch.randint(0, 50, (64, 4))
    drafts[:, :2] = logits[:, :2].argmax(-1)  # a few accepted prefixes to start from
    greedy = kernels.verify_greedy_reference(drafts, logits)
    for a, b in zip(kernels.verify_relaxed(drafts, logits, 0.0), greedy):
        assert torch.equal(a, b)
    probs = torch.softmax(logits, -1)
    for t in (0.3, 0.9):
        accepted, token = kernels.verify_relaxed(drafts, logits, t)
        ok = probs[:, :4].gather(-1, drafts[..., None])[..., 0] >= (1 - t) * probs[:, :4].amax(-1)
        assert torch.equal(accepted, ok.long().cumprod(-1).sum(-1))
        assert torch.equal(token, logits.argmax(-1).gather(1, accepted[:, None])[:, 0])
        assert bool((accepted >= greedy[0]).all())
    assert bool((kernels.verify_relaxed(drafts, logits, 0.9)[0] > greedy[0]).any())
