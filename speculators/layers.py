"""Llama building blocks shared by the drafter families: RMSNorm, rotary embeddings, SwiGLU.

Plain PyTorch with the Llama conventions vLLM and SGLang use (rotate-half RoPE, weight-only
RMSNorm), so a drafter trained here computes what the serving engine computes.
"""

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.quant_matmul import cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecodingLinear(nn.Linear):
    """nn.Linear whose few-row fp32 CPU products (decoding, verification) run kernels.dense_matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.dense_matmul(x, self.weight, self.bias)


def decoding_linears(module: nn.Module) -> nn.Module:
    """Turn every plain nn.Linear of `module` into a DecodingLinear, in place (parameters, ties and
    state_dict unchanged). On SmolLM2-135M (fp32, 1 thread) a 1-token pass then costs about the
    time of reading its weights once, and a 2-token verification about the same; large batches
    (training, prefill) still run F.linear."""
    for layer in module.modules():
        if type(layer) is nn.Linear:
            layer.__class__ = DecodingLinear
    if any(p.device.type == "cpu" for p in module.parameters()):
        cpu_ops()  # build (or load) the kernel now: a load cost, not one inside the first timed decode
    return module


def rope_theta(config) -> float:
    """transformers 5 keeps it in rope_parameters, 4.x in rope_theta."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def rotary(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [..., head_dim] for integer `positions` of any shape."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, head_dim]; cos/sin [T, head_dim] or [B, 1, T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class KVCache:
    """Preallocated keys and values [B, heads, max_len, d], gpt-fast style: appending writes in
    place and rolling back after rejected drafts only moves `length`."""

    def __init__(self, batch: int, heads: int, max_len: int, head_dim: int, device=None, dtype=torch.float32):
        self.k = torch.zeros(batch, heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, heads, m, d] at the end; return all keys and values so far."""
        end = self.length + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache of {self.k.shape[2]} positions is full")
        self.k[:, :, self.length:end], self.v[:, :, self.length:end] = k, v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def crop(self, length: int) -> None:
        self.length = length
