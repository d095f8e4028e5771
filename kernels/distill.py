"""Draft-vocab distillation loss: the drafter's logits z over the draft vocabulary against the
target's logits t restricted to it (t_j = target_logits[draft_to_target[j]]), per token:

    p = softmax(t),  log q = log_softmax(z) = z - lse(z)
    soft CE   = -sum_j p_j log q_j       = lse(z) - sum_j p_j z_j
    KL(p||q)  = sum_j p_j (log p_j - log q_j) = sum_j p_j (t_j - z_j) - lse(t) + lse(z)
    d loss/dz = q - p   (for both: they differ by the entropy of p, which does not involve z)

Position s of the draft is compared with position s + shift of the target (training-time test
trains step j on the target's distribution 1 + j positions ahead); positions without a target
(s >= T - shift) and masked positions have loss 0 and gradient 0. The target is a constant:
no gradient reaches target_logits. Inputs may be fp32, fp16 or bf16 (cast to fp32 before any
arithmetic); the loss is fp32, the gradient has draft_logits' dtype.

The LK losses (arXiv 2602.23881) train the acceptance itself: alpha = sum_j min(p_j, q_j) = 1 - TV(p, q),
the chance that a draft sampled from q is accepted against p (over the draft vocabulary):

    lk        = -log alpha
    lk_hybrid = w KL(p||q) + (1 - w)(1 - alpha),  w = exp(-LK_ETA * alpha) held constant

Their gradient is not q - p, so they run through autograd on the torch definition (`distill_loss_reference`,
a few [B, T, D] fp32 temporaries); soft_ce and kl have the fused paths below.

Three implementations of soft_ce and kl:
- `distill_loss_reference`: plain torch; materialises several [B, T, D] fp32 tensors (p,
  log q, their product, gradients). The test oracle and the benchmark's baseline.
- `distill_loss_chunked` (the CPU path): an autograd.Function over chunks of positions. It
  keeps lse(z) and lse(t) per position for backward (8 bytes each), never [B, T, D]
  probabilities, and recomputes q - p chunk by chunk in backward.
- `distill_loss_triton`: one program per position, online softmax over blocks of the draft
  vocab (running max and rescaled sums), the target gathered through draft_to_target in the
  kernel, forward and backward kernels.
`distill_loss` picks Triton or the chunked path by `forge_kernels.use_triton`.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from forge_kernels.dispatch import use_triton

KINDS = ("soft_ce", "kl", "lk", "lk_hybrid")
FUSED = ("soft_ce", "kl")  # the kinds the chunked and Triton paths implement
LK_ETA = 3.0  # lk_hybrid leans on KL while alpha is small, on TV as alpha grows (the paper's eta)
CHUNK_ELEMENTS = 1 << 18  # positions per chunk of the torch path = CHUNK_ELEMENTS // D (1 MB per fp32 temporary)
BLOCK = 2048  # draft-vocab columns per step of the Triton kernels


def distill_loss(draft_logits, target_logits, draft_to_target, mask, *, kind: str, shift: int = 0):
    """Per-position loss [B, T] (or [T]): draft_logits [B, T, D] (or [T, D]), target_logits
    [B, T, V], draft_to_target [D] target ids, mask [B, T] bool; see the module doc."""
    if kind not in FUSED:
        return distill_loss_reference(draft_logits, target_logits, draft_to_target, mask, kind=kind, shift=shift)
    if use_triton(draft_logits):
        return distill_loss_triton(draft_logits, target_logits, draft_to_target, mask, kind=kind, shift=shift)
    return distill_loss_chunked(draft_logits, target_logits, draft_to_target, mask, kind=kind, shift=shift)


def check_inputs(draft_logits, target_logits, draft_to_target, mask, kind: str, shift: int) -> None:
    """Raise ValueError naming the argument for anything the kernels would read out of bounds or misread."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; choose one of {KINDS}")
    if draft_logits.dim() not in (2, 3) or target_logits.dim() != draft_logits.dim():
        raise ValueError(f"draft_logits and target_logits must both be [T, vocab] or [B, T, vocab], "
                         f"got {tuple(draft_logits.shape)} and {tuple(target_logits.shape)}")
    if draft_logits.shape[:-1] != target_logits.shape[:-1] or mask.shape != draft_logits.shape[:-1]:
        raise ValueError(f"positions differ: draft_logits {tuple(draft_logits.shape)}, target_logits "
                         f"{tuple(target_logits.shape)}, mask {tuple(mask.shape)} (expected mask "
                         f"{tuple(draft_logits.shape[:-1])})")
    for name, x in (("draft_logits", draft_logits), ("target_logits", target_logits)):
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    D, V = draft_logits.shape[-1], target_logits.shape[-1]
    if draft_to_target.dim() != 1 or draft_to_target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_to_target must be a 1-D int64 or int32 tensor, got {draft_to_target.dtype} "
                         f"of shape {tuple(draft_to_target.shape)}")
    if len(draft_to_target) != D:
        raise ValueError(f"draft_to_target has {len(draft_to_target)} entries but draft_logits has D={D} columns")
    devices = {x.device for x in (draft_logits, target_logits, draft_to_target, mask)}
    if len(devices) > 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if D == 0:
        raise ValueError("the draft vocabulary is empty (draft_logits has 0 columns)")
    if int(draft_to_target.min()) < 0 or int(draft_to_target.max()) >= V:
        raise ValueError(f"draft_to_target holds ids outside the target vocabulary 0..{V - 1}")
    if shift < 0:
        raise ValueError(f"shift must be >= 0, got {shift}")


def distill_loss_reference(draft_logits, target_logits, draft_to_target, mask, *, kind: str, shift: int = 0):
    """The plain-torch definition (see the module doc)."""
    check_inputs(draft_logits, target_logits, draft_to_target, mask, kind, shift)
    T = draft_logits.shape[-2]
    n = max(T - shift, 0)  # positions that have a target
    counted = mask[..., :n, None]  # masked positions may hold anything: zeros keep their gradient finite (0)
    log_q = torch.log_softmax(torch.where(counted, draft_logits[..., :n, :].float(), 0.0), dim=-1)
    t = torch.where(counted, target_logits.detach()[..., shift:, :][..., draft_to_target].float(), 0.0)
    if kind == "soft_ce":  # as speculators.eagle3 computes it
        loss = -(torch.softmax(t, dim=-1) * log_q).sum(-1)
    elif kind == "kl":
        loss = F.kl_div(log_q, torch.log_softmax(t, dim=-1), reduction="none", log_target=True).sum(-1)
    else:
        loss = acceptance_loss(log_q, torch.log_softmax(t, dim=-1), kind)
    loss = torch.where(mask[..., :n], loss, 0.0)
    return torch.cat([loss, loss.new_zeros(loss.shape[:-1] + (T - n,))], dim=-1)


def acceptance_loss(log_q: torch.Tensor, log_p: torch.Tensor, kind: str) -> torch.Tensor:
    """The LK losses of the module doc, per position."""
    p, q = log_p.exp(), log_q.exp()
    alpha = torch.minimum(p, q).sum(-1)
    if kind == "lk":
        return -torch.log(alpha.clamp(min=1e-6))
    kl = (p * (log_p - log_q)).sum(-1)
    w = torch.exp(-LK_ETA * alpha.detach())
    return w * kl + (1 - w) * (1 - alpha)


# --- the fused paths: chunked torch and Triton ------------------------------------------------


def distill_loss_chunked(draft_logits, target_logits, draft_to_target, mask, *, kind: str, shift: int = 0,
                         chunk: int | None = None):
    """The CPU path: `chunk` positions at a time (default CHUNK_ELEMENTS // D)."""
    chunk = chunk or max(1, CHUNK_ELEMENTS // max(draft_logits.shape[-1], 1))
    return fused_loss(CHUNKED, chunk, draft_logits, target_logits, draft_to_target, mask, kind, shift)


def distill_loss_triton(draft_logits, target_logits, draft_to_target, mask, *, kind: str, shift: int = 0,
                        block: int = BLOCK):
    """The Triton kernels; `block` draft-vocab columns per step (a power of two)."""
    return fused_loss(TRITON, block, draft_logits, target_logits, draft_to_target, mask, kind, shift)


def fused_loss(path, tile: int, draft_logits, target_logits, draft_to_target, mask, kind: str, shift: int):
    check_inputs(draft_logits, target_logits, draft_to_target, mask, kind, shift)
    if kind not in FUSED:
        raise ValueError(f"kind={kind!r} has no fused path; distill_loss runs it through the reference")
    z, t, m = (draft_logits[None], target_logits[None], mask[None]) if mask.dim() == 1 else (draft_logits, target_logits, mask)
    return _Fused.apply(z, t, draft_to_target, m, kind == "kl", shift, tile, path).view(mask.shape)


class _Fused(torch.autograd.Function):
    """Forward keeps lse(z) and lse(t) per position; backward recomputes q - p from them. `path`
    (CHUNKED or TRITON) does the arithmetic of both."""

    @staticmethod
    def forward(ctx, z, t, d2t, mask, kl: bool, shift: int, tile: int, path):
        loss, lse_z, lse_t = (z.new_zeros(z.shape[:2], dtype=torch.float32) for _ in range(3))
        path.forward(z, t, d2t, mask, kl, shift, tile, loss, lse_z, lse_t)
        ctx.save_for_backward(z, t, d2t, mask, lse_z, lse_t)
        ctx.shift, ctx.tile, ctx.path = shift, tile, path
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        z, t, d2t, mask, lse_z, lse_t = ctx.saved_tensors
        grad_z = torch.zeros_like(z)
        ctx.path.backward(z, t, d2t, mask, lse_z, lse_t, grad_loss, ctx.shift, ctx.tile, grad_z)
        return grad_z, None, None, None, None, None, None, None


def chunks(B: int, n: int, chunk: int):
    """(b, first position, end position) covering positions 0..n-1 of every sequence."""
    return [(b, s, min(s + chunk, n)) for b in range(B) for s in range(0, n, chunk)]


def chunked_forward(z, t, d2t, mask, kl, shift, chunk, loss, lse_z, lse_t):
    for b, s, e in chunks(z.shape[0], max(z.shape[1] - shift, 0), chunk):
        zc = z[b, s:e].float()
        tc = t[b, s + shift:e + shift].index_select(-1, d2t).float()
        lz, lt = zc.logsumexp(-1), tc.logsumexp(-1)
        p = (tc - lt[:, None]).exp()
        x = tc.sub_(zc) if kl else zc  # tc is our own copy: index_select copied it
        mean = (p * x).sum(-1)  # sum_j p_j x_j
        loss[b, s:e] = torch.where(mask[b, s:e], (mean - lt + lz) if kl else (lz - mean), 0.0)
        lse_z[b, s:e], lse_t[b, s:e] = lz, lt


def chunked_backward(z, t, d2t, mask, lse_z, lse_t, grad_loss, shift, chunk, grad_z):
    for b, s, e in chunks(z.shape[0], max(z.shape[1] - shift, 0), chunk):
        q = (z[b, s:e].float() - lse_z[b, s:e, None]).exp_()
        p = (t[b, s + shift:e + shift].index_select(-1, d2t).float() - lse_t[b, s:e, None]).exp_()
        grad = q.sub_(p).mul_(grad_loss[b, s:e, None])  # (q - p) * dloss
        grad_z[b, s:e] = torch.where(mask[b, s:e, None], grad, 0.0)


def triton_forward(z, t, d2t, mask, kl, shift, block, loss, lse_z, lse_t):
    B, T, D = z.shape
    mask_u8 = mask.to(torch.uint8)
    if B * max(T - shift, 0):
        _forward_kernel[(B * max(T - shift, 0),)](
            z, t, d2t, mask_u8, loss, lse_z, lse_t, T, shift, D,
            *z.stride(), *t.stride(), *mask_u8.stride(), KL=kl, BLOCK=block)


def triton_backward(z, t, d2t, mask, lse_z, lse_t, grad_loss, shift, block, grad_z):
    B, T, D = z.shape
    mask_u8, g = mask.to(torch.uint8), grad_loss.contiguous()
    if B * max(T - shift, 0):
        _backward_kernel[(B * max(T - shift, 0),)](
            z, t, d2t, mask_u8, g, lse_z, lse_t, grad_z, T, shift, D,
            *z.stride(), *t.stride(), *mask_u8.stride(), *grad_z.stride(), BLOCK=block)


class FusedPath(NamedTuple):
    forward: Callable
    backward: Callable


CHUNKED = FusedPath(chunked_forward, chunked_backward)
TRITON = FusedPath(triton_forward, triton_backward)


@triton.jit
def _forward_kernel(z_ptr, t_ptr, d2t_ptr, mask_ptr, loss_ptr, lse_z_ptr, lse_t_ptr, T, shift, D,
                    z_sb, z_st, z_sv, t_sb, t_st, t_sv, m_sb, m_st, KL: tl.constexpr, BLOCK: tl.constexpr):
    # Program = draft position (b, s), s < n = T - shift; its target is at (b, s + shift).
    pid = tl.program_id(0).to(tl.int64)
    b, s = pid // (T - shift), pid % (T - shift)
    z_row = z_ptr + b * z_sb + s * z_st
    t_row = t_ptr + b * t_sb + (s + shift) * t_st
    # Running maxima m, sums l = sum exp(x - m), and acc = sum_j exp(t_j - m_t) x_j with
    # x = z (soft CE) or t - z (KL); when a maximum grows the sums are rescaled by exp(m_old - m_new).
    m_z = float("-inf")
    l_z = 0.0
    m_t = float("-inf")
    l_t = 0.0
    acc = 0.0
    for start in range(0, D, BLOCK):
        cols, ok, z, t = _columns(z_row, t_row, d2t_ptr, start, D, z_sv, t_sv, BLOCK)
        m_z_new = tl.maximum(m_z, tl.max(tl.where(ok, z, float("-inf")), 0))
        l_z = l_z * tl.exp(m_z - m_z_new) + tl.sum(tl.where(ok, tl.exp(z - m_z_new), 0.0), 0)
        m_z = m_z_new
        m_t_new = tl.maximum(m_t, tl.max(tl.where(ok, t, float("-inf")), 0))
        rescale = tl.exp(m_t - m_t_new)
        w = tl.where(ok, tl.exp(t - m_t_new), 0.0)  # exp(t_j - m_t), 0 past D
        if KL:
            x = t - z
        else:
            x = z
        l_t = l_t * rescale + tl.sum(w, 0)
        acc = acc * rescale + tl.sum(w * x, 0)
        m_t = m_t_new
    lse_z = m_z + tl.log(l_z)
    lse_t = m_t + tl.log(l_t)
    mean = acc / l_t  # sum_j p_j x_j
    if KL:
        loss = mean - lse_t + lse_z
    else:
        loss = lse_z - mean
    active = tl.load(mask_ptr + b * m_sb + s * m_st) != 0
    out = b * T + s  # the outputs are contiguous [B, T]
    tl.store(loss_ptr + out, tl.where(active, loss, 0.0))
    tl.store(lse_z_ptr + out, lse_z)
    tl.store(lse_t_ptr + out, lse_t)


@triton.jit
def _backward_kernel(z_ptr, t_ptr, d2t_ptr, mask_ptr, g_ptr, lse_z_ptr, lse_t_ptr, grad_ptr, T, shift, D,
                     z_sb, z_st, z_sv, t_sb, t_st, t_sv, m_sb, m_st, dz_sb, dz_st, dz_sv, BLOCK: tl.constexpr):
    # grad z_j = (q_j - p_j) * dloss, from the saved lse(z) and lse(t); 0 on masked positions.
    pid = tl.program_id(0).to(tl.int64)
    b, s = pid // (T - shift), pid % (T - shift)
    z_row = z_ptr + b * z_sb + s * z_st
    t_row = t_ptr + b * t_sb + (s + shift) * t_st
    out = b * T + s
    active = tl.load(mask_ptr + b * m_sb + s * m_st) != 0
    g = tl.where(active, tl.load(g_ptr + out), 0.0)
    lse_z = tl.load(lse_z_ptr + out)
    lse_t = tl.load(lse_t_ptr + out)
    for start in range(0, D, BLOCK):
        cols, ok, z, t = _columns(z_row, t_row, d2t_ptr, start, D, z_sv, t_sv, BLOCK)
        grad = tl.where(active, (tl.exp(z - lse_z) - tl.exp(t - lse_t)) * g, 0.0)
        tl.store(grad_ptr + b * dz_sb + s * dz_st + cols * dz_sv, grad.to(grad_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _columns(z_row, t_row, d2t_ptr, start, D, z_sv, t_sv, BLOCK: tl.constexpr):
    """Draft columns start.. start + BLOCK: their indices, which exist, z and the target's t gathered by d2t."""
    cols = start + tl.arange(0, BLOCK)
    ok = cols < D
    ids = tl.load(d2t_ptr + cols, mask=ok, other=0)
    z = tl.load(z_row + cols * z_sv, mask=ok, other=0.0).to(tl.float32)
    t = tl.load(t_row + ids * t_sv, mask=ok, other=0.0).to(tl.float32)
    return cols, ok, z, t
