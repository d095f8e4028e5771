"""Batched verification of draft chains, the rule inference/engine.py's module doc states (inference.engine
applies it to one chain).

drafts [B, K] are target token ids; target_logits [B, K+1, V] come from the target's pass
over [last token, *drafts], so row i scores the token after draft i-1. Both rules return
accepted [B] (0..K drafts kept) and token [B], the token emitted after them.

Greedy: accepted a = the longest prefix with drafts[i] == argmax(target_logits[i]);
token = argmax(target_logits[a]).

Relaxed greedy (typical acceptance, `tolerance` t in [0, 1), off at 0): draft i is also accepted
when the target gives it at least (1 - t) times its top probability, p_i(x_i) >= (1 - t) max p_i
(Medusa-2's typical acceptance and speculators' accept_tolerance relax verification the same way);
token = argmax(target_logits[a]). It buys acceptance at the cost of the target's exact output: t = 0
is the greedy rule itself.

Sampling (lossless): p = softmax(target_logits / temperature), q = draft_probs [B, K, V], the
drafter's distribution over the target vocabulary. Draft x_i is accepted iff
u_i < p_i(x_i) / q_i(x_i), i.e. with probability min(1, p/q); a = the first rejected i, K if
none. token ~ norm(max(0, p_a - q_a)) after a rejection and ~ p_K after none, which is the
same formula with q_K = 0. The draw inverts the CDF with u_K: token = #{j : cdf_j <= u_K *
total}, the first j whose cumulative weight exceeds the fraction u_K of the total.
uniform [B, K+1] holds u_0..u_K in [0, 1): randomness is an input, so the reference and the
kernel make the same choices (they can differ only where a u lands within float rounding of a
decision boundary).

The Triton path: one kernel computes argmax and logsumexp(logits / temperature) of every row
in one pass over the vocabulary (online, in blocks); the accept test needs only p at the [B, K]
drafted ids and is a few torch ops; a second kernel draws each chain's token from its row a.
"""

import torch
import triton
import triton.language as tl

from forge_kernels.dispatch import use_triton

BLOCK = 2048  # vocabulary columns per step of the Triton kernels


def verify_greedy(drafts, target_logits):
    """(accepted [B], token [B]); see the module doc."""
    if use_triton(target_logits):
        return verify_greedy_triton(drafts, target_logits)
    return verify_greedy_reference(drafts, target_logits)


def verify_relaxed(drafts, target_logits, tolerance: float):
    """(accepted [B], token [B]) under the relaxed greedy rule of the module doc; t = 0 is verify_greedy."""
    if tolerance == 0:
        return verify_greedy(drafts, target_logits)
    check_inputs(drafts, target_logits)
    probs = torch.softmax(target_logits[:, :-1].float(), dim=-1)
    drafted = probs.gather(-1, drafts.long()[..., None])[..., 0]
    argmax = target_logits.argmax(-1)
    accepted = accepted_prefix((drafts == argmax[:, :-1]) | (drafted >= (1 - tolerance) * probs.amax(-1)))
    return accepted, argmax.gather(1, accepted[:, None])[:, 0]


def verify_sampling(drafts, draft_probs, target_logits, temperature: float, uniform):
    """(accepted [B], token [B]); see the module doc."""
    if use_triton(target_logits):
        return verify_sampling_triton(drafts, draft_probs, target_logits, temperature, uniform)
    return verify_sampling_reference(drafts, draft_probs, target_logits, temperature, uniform)


def check_inputs(drafts, target_logits, draft_probs=None, temperature: float = 1.0, uniform=None) -> None:
    """Raise ValueError naming the argument for anything the kernels would read out of bounds or misread."""
    if drafts.dim() != 2 or drafts.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"drafts must be a [B, K] int64 or int32 tensor, got {drafts.dtype} of shape "
                         f"{tuple(drafts.shape)}")
    B, K = drafts.shape
    if target_logits.dim() != 3 or target_logits.shape[:2] != (B, K + 1):
        raise ValueError(f"target_logits must be [B, K+1, V] = [{B}, {K + 1}, V] for drafts of shape "
                         f"{tuple(drafts.shape)}, got {tuple(target_logits.shape)}")
    V = target_logits.shape[-1]
    named = [("target_logits", target_logits)]
    if draft_probs is not None:
        if draft_probs.shape != (B, K, V):
            raise ValueError(f"draft_probs must be [B, K, V] = [{B}, {K}, {V}], got {tuple(draft_probs.shape)}")
        if uniform.shape != (B, K + 1):
            raise ValueError(f"uniform must be [B, K+1] = [{B}, {K + 1}], got {tuple(uniform.shape)}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 for sampling (use greedy for 0), got {temperature}")
        if uniform.dtype != torch.float32:  # coarser floats would bias the accept test and the draw
            raise ValueError(f"uniform must be float32, got {uniform.dtype}")
        named += [("draft_probs", draft_probs), ("uniform", uniform)]
    for name, x in named:
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    devices = {x.device for x in (drafts, *(x for _, x in named))}
    if len(devices) > 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if V == 0:
        raise ValueError("target_logits has an empty vocabulary")
    if drafts.numel() and (int(drafts.min()) < 0 or int(drafts.max()) >= V):
        raise ValueError(f"drafts hold token ids outside the target vocabulary 0..{V - 1}")


def accepted_prefix(ok: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> [B]: the number of leading True values."""
    return ok.long().cumprod(-1).sum(-1)


def greedy_from_argmax(drafts, argmax):
    """The greedy rule given argmax [B, K+1] of the target's rows."""
    accepted = accepted_prefix(drafts == argmax[:, :-1])
    return accepted, argmax.gather(1, accepted[:, None])[:, 0]


def verify_greedy_reference(drafts, target_logits):
    check_inputs(drafts, target_logits)
    return greedy_from_argmax(drafts.long(), target_logits.argmax(-1))


def verify_sampling_reference(drafts, draft_probs, target_logits, temperature: float, uniform):
    check_inputs(drafts, target_logits, draft_probs, temperature, uniform)
    B, K = drafts.shape
    drafts, u = drafts.long(), uniform
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    q = torch.cat([draft_probs.float(), p.new_zeros(B, 1, p.shape[-1])], dim=1)  # q_K = 0
    at_draft = drafts[..., None]
    accepted = accepted_prefix(u[:, :K] < p[:, :K].gather(-1, at_draft)[..., 0] / q[:, :K].gather(-1, at_draft)[..., 0])
    rows = torch.arange(B, device=drafts.device)
    residual = (p[rows, accepted] - q[rows, accepted]).clamp(min=0)  # p_a - q_a, or p_K
    cdf = residual.cumsum(-1)
    token = (cdf <= u[:, K, None] * cdf[:, -1:]).sum(-1).clamp(max=p.shape[-1] - 1)
    return accepted, token


# --- Triton path -----------------------------------------------------------------------------


def verify_greedy_triton(drafts, target_logits, block: int = BLOCK):
    check_inputs(drafts, target_logits)
    argmax, _ = row_stats(target_logits, 1.0, block)
    return greedy_from_argmax(drafts.long(), argmax)


def verify_sampling_triton(drafts, draft_probs, target_logits, temperature: float, uniform, block: int = BLOCK):
    check_inputs(drafts, target_logits, draft_probs, temperature, uniform)
    B, K = drafts.shape
    drafts, u = drafts.long(), uniform.contiguous()
    _, lse = row_stats(target_logits, temperature, block)
    # p_i(x_i) = exp(logit_i(x_i) / temperature - lse_i): only the drafted ids, no [B, K, V] softmax.
    at_draft = drafts[..., None]
    p_x = torch.exp(target_logits[:, :K].gather(-1, at_draft)[..., 0].float() / temperature - lse[:, :K])
    accepted = accepted_prefix(u[:, :K] < p_x / draft_probs.gather(-1, at_draft)[..., 0].float())
    token = torch.empty(B, dtype=torch.int64, device=drafts.device)
    _sample_kernel[(B,)](
        target_logits, draft_probs, lse, accepted, u, token, K, target_logits.shape[-1], temperature,
        *target_logits.stride(), *draft_probs.stride(), BLOCK=block)
    return accepted, token


def row_stats(logits, temperature: float, block: int):
    """argmax and logsumexp(logits / temperature) of every row of [B, K+1, V], each [B, K+1]."""
    B, R, V = logits.shape
    argmax = torch.empty(B, R, dtype=torch.int64, device=logits.device)
    lse = torch.empty(B, R, dtype=torch.float32, device=logits.device)
    _row_stats_kernel[(B * R,)](logits, argmax, lse, R, V, temperature, *logits.stride(), BLOCK=block)
    return argmax, lse


@triton.jit
def _row_stats_kernel(logits_ptr, argmax_ptr, lse_ptr, R, V, temperature, s_b, s_r, s_v, BLOCK: tl.constexpr):
    # Program = row (b, i). The first maximum wins ties, as in torch.argmax.
    pid = tl.program_id(0).to(tl.int64)
    row = logits_ptr + (pid // R) * s_b + (pid % R) * s_r
    best = float("-inf")
    best_at = 0
    m = float("-inf")
    l = 0.0  # sum exp(x - m) over the columns so far, rescaled when m grows
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row + cols * s_v, mask=cols < V, other=float("-inf")).to(tl.float32) / temperature
        block_max = tl.max(x, 0)
        best_at = tl.where(block_max > best, start + tl.argmax(x, 0), best_at)
        best = tl.maximum(best, block_max)
        m_new = tl.maximum(m, block_max)
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    tl.store(argmax_ptr + pid, best_at.to(tl.int64))
    tl.store(lse_ptr + pid, m + tl.log(l))


@triton.jit
def _sample_kernel(logits_ptr, q_ptr, lse_ptr, accepted_ptr, u_ptr, token_ptr, K, V, temperature,
                   l_sb, l_sr, l_sv, q_sb, q_sr, q_sv, BLOCK: tl.constexpr):
    # Program = chain b: draw from w = max(0, p_a - q_a) (q_K = 0) by inverting its CDF with u_K.
    b = tl.program_id(0).to(tl.int64)
    a = tl.load(accepted_ptr + b)
    q_len = tl.where(a < K, V, 0)  # q_K = 0: read no column of q
    logits_row = logits_ptr + b * l_sb + a * l_sr
    q_row = q_ptr + b * q_sb + tl.minimum(a, K - 1) * q_sr
    lse = tl.load(lse_ptr + b * (K + 1) + a)
    total = 0.0
    for start in range(0, V, BLOCK):
        w, ok = _residual(logits_row, q_row, start, V, q_len, l_sv, q_sv, temperature, lse, BLOCK)
        total += tl.sum(w, 0)
    threshold = tl.load(u_ptr + b * (K + 1) + K) * total
    below = 0  # columns whose cumulative weight is <= threshold
    cdf = 0.0
    for start in range(0, V, BLOCK):
        w, ok = _residual(logits_row, q_row, start, V, q_len, l_sv, q_sv, temperature, lse, BLOCK)
        below += tl.sum((((cdf + tl.cumsum(w, 0)) <= threshold) & ok).to(tl.int32), 0)
        cdf += tl.sum(w, 0)
    tl.store(token_ptr + b, tl.minimum(below, V - 1).to(tl.int64))


@triton.jit
def _residual(logits_row, q_row, start, V, q_len, l_sv, q_sv, temperature, lse, BLOCK: tl.constexpr):
    """Columns start.. start + BLOCK of max(0, p - q) (0 past V, and q = 0 past q_len), and which exist."""
    cols = start + tl.arange(0, BLOCK)
    ok = cols < V
    p = tl.exp(tl.load(logits_row + cols * l_sv, mask=ok, other=float("-inf")).to(tl.float32) / temperature - lse)
    q = tl.load(q_row + cols * q_sv, mask=cols < q_len, other=0.0).to(tl.float32)
    return tl.maximum(p - q, 0.0), ok
