"""Llama building blocks shared by the drafter families: RMSNorm, rotary embeddings, SwiGLU, the
attention and decoder layer, the training-time-test attention, the serving caches.

Plain PyTorch with the Llama conventions vLLM and SGLang use (rotate-half RoPE, weight-only
RMSNorm), so a drafter trained here computes what the serving engine computes.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

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


def layer_config(target, intermediate_size: int | None = None) -> LlamaConfig:
    """A drafter's decoder layer for `target` (a speculators.target.FrozenTarget): the target's attention and MLP
    shapes (the MLP as wide as `intermediate_size` when given), one layer, the target's vocab."""
    c = target.config
    return LlamaConfig(
        hidden_size=c.hidden_size, intermediate_size=intermediate_size or c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6), max_position_embeddings=c.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta(c)},
        num_hidden_layers=1, vocab_size=target.vocab_size, tie_word_embeddings=False,
    )


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


class RotaryTable:
    """cos, sin [positions, head_dim] of a layer config, computed once per growth (or device): while
    serving, every drafter call would otherwise rebuild them."""

    def __init__(self, layer_cfg: LlamaConfig):
        self.head_dim, self.theta = layer_cfg.head_dim, rope_theta(layer_cfg)
        self.table = None

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., head_dim] of integer `positions` of any shape (training: computed, not cached)."""
        return rotary(positions, self.head_dim, self.theta)

    def __call__(self, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.table is None or len(self.table[0]) < length or self.table[0].device != torch.device(device):
            self.table = rotary(torch.arange(max(length, 1024), device=device), self.head_dim, self.theta)
        return self.table


class LlamaAttention(nn.Module):
    """Llama attention over inputs `in_features` wide: 2H in EAGLE-3 (embeddings and hidden
    side by side), H in EAGLE-1 and P-EAGLE's later layers."""

    def __init__(self, c: LlamaConfig, in_features: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(in_features, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated q [B, heads, T, d] and k, v [B, heads, T, d] (kv heads repeated for GQA)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


class LlamaDecoderLayer(nn.Module):
    """Attention over an input `in_features` wide, o_proj, residual add and MLP. The families give it
    their own attention input: EAGLE-1 fc's output as is, EAGLE-3 a 2H concatenation, P-EAGLE a norm."""

    def __init__(self, c: LlamaConfig, in_features: int):
        super().__init__()
        self.self_attn = LlamaAttention(c, in_features)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def finish(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """o_proj, residual add and MLP; attn is [B, heads, T, d]."""
        B, _, T, _ = attn.shape
        h = residual + self.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3DecoderLayer(LlamaDecoderLayer):
    """EAGLE-3's layer (also P-EAGLE's first): attention over concat(input_layernorm(embed), hidden_norm(h)),
    2H wide; the residual carries h."""

    def __init__(self, c: LlamaConfig, norm_before_residual: bool):
        super().__init__(c, 2 * c.hidden_size)
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor):
        """(residual, 2H-wide attention input) for token embeddings and hidden states."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return residual, torch.cat([self.input_layernorm(embeds), normed], dim=-1)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Attention of training-time-test step j = len(keys) - 1, all tensors [B, heads, T, d].

    keys[0]/values[0] come from step 0 and are seen causally; keys[i] (i >= 1) from step i
    and are seen only at the query's own position (the diagonal). One fused attention over the
    steps' keys side by side, under that mask: it never materialises the scores, which cost more
    in copies and gradients than in arithmetic (about 1.7x faster than an explicit softmax on CPU).
    """
    return F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2),
                                          attn_mask=ttt_mask(q.shape[2], len(keys), q.device))


def ttt_mask(T: int, steps: int, device) -> torch.Tensor:
    """[T, steps * T] bool: causal over step 0's keys, the diagonal of every later step's."""
    mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return torch.cat([mask, *[torch.eye(T, dtype=torch.bool, device=device)] * (steps - 1)], dim=1)


def cached_layer(layer: LlamaDecoderLayer, rotary_table: RotaryTable, cache: "KVCache", residual: torch.Tensor,
                 x: torch.Tensor, positions: torch.Tensor | None, visible: torch.Tensor | None) -> torch.Tensor:
    """`layer` over m positions appended after `cache` (attention input x [B, m, *], residual [B, m, H]).
    Positions default to the next m and attention to causal; a tree draft passes its nodes' rotary
    positions and `visible` [m, cache.length + m] (context and own ancestors). `cache.crop` undoes it."""
    start, m = cache.length, x.shape[1]
    if positions is None:
        cos, sin = (table[start : start + m] for table in rotary_table(start + m, x.device))
        visible = torch.arange(start + m, device=x.device)[None, :] <= torch.arange(
            start, start + m, device=x.device)[:, None]
    else:
        cos, sin = (table[positions] for table in rotary_table(int(positions.max()) + 1, x.device))
    q, k, v = layer.self_attn.qkv(x, cos, sin)
    keys, values = cache.append(k, v)
    return layer.finish(residual, F.scaled_dot_product_attention(q, keys, values, attn_mask=visible))


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] padded with zeros to x's length along dim 1: the value n positions ahead."""
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1)


class KVCache:
    """Preallocated keys and values [B, heads, max_len, d], gpt-fast style: appending writes in
    place and rolling back after rejected drafts only moves `length`."""

    def __init__(self, batch: int, heads: int, max_len: int, head_dim: int, device=None, dtype=torch.float32):
        self.k = torch.zeros(batch, heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    @classmethod
    def of(cls, layer_cfg: LlamaConfig, batch: int, max_len: int, device=None) -> "KVCache":
        """An empty cache for a decoder layer of `layer_cfg`."""
        return cls(batch, layer_cfg.num_attention_heads, max_len, layer_cfg.head_dim, device)

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


class LayerCaches(list):
    """One KVCache per decoder layer, grown and cropped together."""

    @classmethod
    def of(cls, layer_cfg: LlamaConfig, layers: int, batch: int, max_len: int, device=None) -> "LayerCaches":
        return cls(KVCache.of(layer_cfg, batch, max_len, device) for _ in range(layers))

    @property
    def length(self) -> int:
        return self[0].length

    def crop(self, length: int) -> None:
        for cache in self:
            cache.crop(length)
