"""Llama building blocks shared by the drafter families: RMSNorm, rotary embeddings, SwiGLU, the
attention and decoder layer, the training-time-test attention, the serving caches.

Plain PyTorch with the Llama conventions vLLM and SGLang use (rotate-half RoPE, weight-only
RMSNorm), so a drafter trained here computes what the serving engine computes.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

import forge_kernels as kernels
from forge_kernels.quant_matmul import cpu_ops


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


# Shapes of a drafter layer for targets whose own layer would make it large. MLA (DeepSeek-V2/V3, Kimi-K2): 128
# latent-projected heads and a dense MLP of the first layers, about 1B parameters as a plain drafter layer at
# DeepSeek-V3's scale. The drafter gets plain GQA heads of 128 dims, at most 8 KV heads (SpecForge's DeepSeek-V3
# drafter: 56 heads, 8 KV heads for hidden 7,168) and an MLP twice the hidden size (ModelOpt's 14,336 for 7,168).
# A plain target keeps its own shapes unless its queries are wider than 2x hidden, its heads do not divide the
# hidden size (GLM-4.5: 96 heads, hidden 5,120; a Llama layer needs them to), or its MLP is wider than 4x hidden.
DRAFTER_HEAD_DIM = 128
DRAFTER_MAX_KV_HEADS = 8
MLA_MLP_WIDTH = 2  # x hidden
MAX_QUERY_WIDTH, MAX_MLP_WIDTH = 2, 4  # x hidden, for targets without MLA
# Rope kinds RotaryTable computes from transformers' own frequency functions (the others change with the
# sequence length: dynamic NTK, LongRoPE's short and long factors).
ROPE_KINDS = ("default", "linear", "yarn", "llama3")
_said: set[str] = set()


def say_once(line: str) -> None:
    """Print `line` the first time this process says it (a drafter is built again for its export copy)."""
    if line not in _said:
        _said.add(line)
        print(line, flush=True)


def is_mla(config) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash): keys and values from a low-rank latent."""
    return getattr(config, "kv_lora_rank", None) is not None


def layer_config(target, intermediate_size: int | None = None) -> LlamaConfig:
    """A drafter's decoder layer for `target` (a speculators.target.FrozenTarget): the target's attention and MLP
    shapes (the MLP as wide as `intermediate_size` when given) unless they would make the drafter large (MLA, very
    wide targets: drafter_shape, said in one line), its rope (drafter_rope), one layer, the target's vocab."""
    c = target.config
    heads, kv_heads, head_dim, width = drafter_shape(c, intermediate_size)
    return LlamaConfig(
        hidden_size=c.hidden_size, intermediate_size=width, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
        max_position_embeddings=c.max_position_embeddings, rope_parameters=drafter_rope(c),
        num_hidden_layers=1, vocab_size=target.vocab_size, tie_word_embeddings=False,
    )


def drafter_shape(c, intermediate_size: int | None = None) -> tuple[int, int, int, int]:
    """(heads, KV heads, head dim, MLP width) of the drafter layer for a target of config `c`."""
    H = c.hidden_size
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or H // heads
    width = getattr(c, "intermediate_size", None) or MAX_MLP_WIDTH * H
    said = []
    if is_mla(c) or heads * head_dim > MAX_QUERY_WIDTH * H or H % heads:
        own = (f"MLA ({heads} heads, kv_lora_rank {c.kv_lora_rank})" if is_mla(c) else
               f"{heads} heads x {head_dim} ({heads * head_dim:,} wide, over {MAX_QUERY_WIDTH}x hidden)"
               if heads * head_dim > MAX_QUERY_WIDTH * H else f"{heads} heads, which do not divide hidden {H}")
        head_dim = min(DRAFTER_HEAD_DIM, H // 4)
        heads = H // head_dim
        kv_heads = max(d for d in range(1, DRAFTER_MAX_KV_HEADS + 1) if heads % d == 0)
        said.append(f"attention {heads} heads x {head_dim} ({kv_heads} KV heads), not the target's {own}")
    if intermediate_size is None and (is_mla(c) or width > MAX_MLP_WIDTH * H):
        small = MLA_MLP_WIDTH * H if is_mla(c) else MAX_MLP_WIDTH * H
        if small != width:
            said.append(f"an MLP {small:,} wide ({small // H}x hidden), not the target's {width:,}")
        width = small
    if said:
        say_once(f"drafter layer for this {c.model_type} target: {' and '.join(said)}, as SpecForge and ModelOpt "
                 f"shape DeepSeek-V3 drafters (drafter.intermediate_size sets the MLP)")
    return heads, kv_heads, head_dim, intermediate_size or width


def drafter_rope(c) -> dict:
    """The drafter's rope parameters: the target's kind (linear, YaRN, Llama-3 scaling) where RotaryTable computes
    it; of a target with a rope per layer type (Gemma-3), its full-attention layers' (the drafter attends over the
    whole context); otherwise plain RoPE at the target's theta. Said in one line unless plain RoPE is the target's."""
    params = dict(getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": rope_theta(c)})
    source = "the target's"
    if "full_attention" in params and isinstance(params["full_attention"], dict):  # one rope per layer type
        others = {kind: describe_rope(p) for kind, p in params.items() if kind != "full_attention"}
        params = dict(params["full_attention"])
        source = "the target's full-attention layers' (not its " + ", ".join(
            f"{kind.replace('_attention', '')} layers' {rope}" for kind, rope in others.items()) + ")"
    partial = params.pop("partial_rotary_factor", None) or getattr(c, "partial_rotary_factor", None)
    kind = params.get("rope_type", "default")
    if kind not in ROPE_KINDS:
        params = {"rope_type": "default", "rope_theta": float(params.get("rope_theta", rope_theta(c)))}
        source = f"plain RoPE instead of the target's {kind} (its frequencies change with the sequence length)"
    params = {k: v for k, v in params.items() if v is not None}
    if kind != "default" or source != "the target's" or partial not in (None, 1.0):
        rotated = "" if partial in (None, 1.0) else f", rotating every dim of its heads (the target: {partial:.0%})"
        say_once(f"drafter rope: {describe_rope(params)}, {source}{rotated}")
    return params


def describe_rope(params: dict) -> str:
    """'yarn (factor 32, theta 150000)'."""
    kind = params.get("rope_type", "default")
    extra = f"factor {params['factor']:g}, " if "factor" in params else ""
    theta = float(params.get("rope_theta", 10000))
    return f"{'plain RoPE' if kind == 'default' else kind} ({extra}theta {theta:.0f})"


def rope_theta(config) -> float:
    """transformers 5 keeps it in rope_parameters, 4.x in rope_theta."""
    params = getattr(config, "rope_parameters", None) or {}
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def rope_frequencies(layer_cfg: LlamaConfig) -> tuple[torch.Tensor | None, float]:
    """(inverse frequencies [head_dim / 2], cos/sin scale) of a layer config's rope, by transformers' own
    functions; (None, 1.0) for plain RoPE, which `rotary` computes from theta."""
    params = getattr(layer_cfg, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    if kind == "default":
        return None, 1.0
    if kind not in ROPE_KINDS:
        raise ValueError(f"rope_type {kind!r}: the drafter's rotary table computes {', '.join(ROPE_KINDS)}")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # YaRN's remark on max_position_embeddings, once per table
    try:
        with torch.device("cpu"):  # real numbers even where the drafter is built on the meta device
            inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](layer_cfg, torch.device("cpu"))
    finally:
        hf_logging.set_verbosity(verbosity)
    return inv_freq.float(), float(scale)


def rotary(positions: torch.Tensor, head_dim: int, theta: float, inv_freq: torch.Tensor | None = None,
           scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [..., head_dim] for integer `positions` of any shape: plain RoPE at `theta`, or the
    given inverse frequencies and scale (linear, YaRN, Llama-3 scaling: rope_frequencies)."""
    if inv_freq is None:
        dims = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
        inv_freq = 1.0 / theta ** (dims / head_dim)
    angles = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * scale, angles.sin() * scale


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
        self.inv_freq, self.scale = rope_frequencies(layer_cfg)
        self.table = None

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., head_dim] of integer `positions` of any shape (training: computed, not cached)."""
        return rotary(positions, self.head_dim, self.theta, self.inv_freq, self.scale)

    def __call__(self, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.table is None or len(self.table[0]) < length or self.table[0].device != torch.device(device):
            self.table = rotary(torch.arange(max(length, 1024), device=device), self.head_dim, self.theta,
                                self.inv_freq, self.scale)
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
