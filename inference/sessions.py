"""Target decoding sessions: a KV cache that grows as tokens are verified and rolls back.

`StaticSession` runs a Llama-family target (Llama, Qwen2, Qwen3, Mistral) with a short loop
over its own transformers modules and a preallocated cache, gpt-fast style: rolling back is
moving `length`, and one decode step is a few dozen PyTorch calls. Per-call overhead, not
arithmetic, decides decode speed for small models on CPUs (docs/real-target.md, decode cost), and HF's
generic forward spends most of a step there. `HFSession` runs any other causal LM through
transformers with a DynamicCache. Both return a speculators.target.TargetOutput.

A batch of prompts shares one rectangular cache whose slots a `BatchSlots` describes: rows are
left-padded to a common prompt length and then advance by their own accepted counts, so a slot
may be a pad or a hole (a draft its row rejected while another row accepted its own). No real
query sees a pad or a hole, and each token's position (rotary angle, or HF's position_ids) counts
the real tokens before it in its row. A pad slot's query sees only itself, so its (unused)
outputs stay finite instead of softmax-over-nothing NaNs that would leak into real rows through
0 * NaN. `select(index)` keeps the rows still decoding. Without slots the session decodes one
sequence.
"""

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

from common.config import UserError
from speculators.quant import stack_linears
from speculators.target import FrozenTarget, TargetOutput

STATIC_MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral"}


class BatchSlots:
    """The cache slots of a batch whose rows hold different numbers of tokens (shared by the target's
    session and the drafter's cache, which index the same slots). `valid[r, s]`: row r's slot s holds
    a real token (future slots count as real); `position[r, s]`: its position in row r."""

    def __init__(self, pads: torch.Tensor, max_len: int):
        slots = torch.arange(max_len, device=pads.device)
        self.valid = slots[None] >= pads[:, None]
        self.position = (slots[None] - pads[:, None]).clamp(min=0)

    def __len__(self) -> int:
        return len(self.valid)

    def positions(self, start: int, end: int) -> torch.Tensor:
        """[B, end - start]: the positions of slots start..end-1, row by row."""
        return self.position[:, start:end]

    def visible(self, start: int, end: int) -> torch.Tensor:
        """[B, 1, end - start, end]: which slots each query of start..end-1 sees (causal, no pads or holes)."""
        slots, keys = torch.arange(start, end, device=self.valid.device), torch.arange(end, device=self.valid.device)
        causal, own = keys[None] <= slots[:, None], keys[None] == slots[:, None]
        return ((causal & self.valid[:, None, :end]) | own)[:, None]

    def keep(self, start: int, kept: torch.Tensor, end: int) -> None:
        """After a pass over slots start.., row r keeps its first kept[r] of them and the batch goes on at
        `end` (start + the largest kept): the rest up to `end` become holes, later slots follow each row's
        last kept token."""
        slots = torch.arange(self.valid.shape[1], device=self.valid.device)
        self.valid &= ~((slots[None] >= start + kept[:, None]) & (slots[None] < end))
        self.position[:, end:] = self.position[:, start, None] + kept[:, None] + slots[None, : len(slots) - end]

    def select(self, index: torch.Tensor) -> None:
        self.valid, self.position = self.valid[index], self.position[index]


class HFSession:
    def __init__(self, target: FrozenTarget, slots: BatchSlots | None = None):
        self.target, self.cache, self.length, self.slots = target, DynamicCache(), 0, slots

    def __call__(self, tokens: torch.Tensor, tree: torch.Tensor | None = None,
                 depths: torch.Tensor | None = None, logits: str = "all") -> TargetOutput:
        if tree is not None:
            raise UserError(f"tree drafts need a Llama-family target ({', '.join(sorted(STATIC_MODEL_TYPES))}) "
                            f"without a sliding window, on one device (no target.device_map); use drafting.mode=chain")
        if self.slots is not None:
            return self.padded(tokens, logits)
        self.length += tokens.shape[1]
        return self.target(tokens, cache=self.cache, logits=logits)

    def padded(self, tokens: torch.Tensor, logits: str) -> TargetOutput:
        """A batch: attention mask over every slot so far (pads and holes hidden), position ids per row."""
        start, end = self.length, self.length + tokens.shape[1]
        mask, positions = self.slots.valid[:, :end].to(tokens.device), self.slots.positions(start, end).to(tokens.device)
        self.length = end
        return self.target(tokens, mask.long(), cache=self.cache, position_ids=positions, logits=logits)

    def select(self, index: torch.Tensor) -> None:
        """Keep the batch rows `index` (the prompts still decoding); the caller selects the slots."""
        self.cache.batch_select_indices(index)

    def keep(self, start: int, rows: list[int]) -> None:
        self.crop(start + len(rows))  # chains only: the accepted rows are a prefix

    def crop(self, length: int) -> None:
        if length < self.length:
            self.cache.crop(length - self.length)  # transformers 5: negative = positions to drop
        self.length = length


class RecurrentSession(HFSession):
    """A hybrid target's session (linear attention or state-space layers beside attention: Qwen3-Next, LFM2,
    GraniteMoeHybrid): its recurrent and conv states cannot be cropped back past rejected drafts, so each
    pass first snapshots them, and a rollback restores the snapshot of the pass it lands in, crops the
    attention layers' keys and values to it, and runs the kept tokens of that pass again (one more target
    pass, of the accepted tokens, whenever a draft is partly rejected). The snapshot holds the states
    alone: a few MB per layer at real scale, however long the sequence."""

    def __init__(self, target: FrozenTarget, slots: BatchSlots | None = None):
        if slots is not None:
            raise UserError(f"target {target.name_or_path} has recurrent layers (linear attention or state-space), "
                            f"which a batch's holes cannot skip; serve it with batch_size=1")
        super().__init__(target)
        self.cache = DynamicCache(config=target.model.config)
        self.passes = []  # (length before, the states then, the tokens) of the passes a rollback may land in

    def __call__(self, tokens: torch.Tensor, tree: torch.Tensor | None = None,
                 depths: torch.Tensor | None = None, logits: str = "all") -> TargetOutput:
        self.passes = [*self.passes[-(ROLLBACK_PASSES - 1):], (self.length, self.states(), tokens)]
        return super().__call__(tokens, tree, depths, logits)

    def crop(self, length: int) -> None:
        if length >= self.length:
            return
        index = max(i for i, (before, _, _) in enumerate(self.passes) if before <= length)
        before, states, tokens = self.passes[index]
        self.passes = self.passes[:index]
        for layer, state in zip(self.cache.layers, states):
            if state is not None:
                vars(layer).update(state)
            if isinstance(layer, DynamicLayer):
                DynamicLayer.crop(layer, before - self.length)
        self.length = before
        if length > before:
            self(tokens[:, : length - before])

    def states(self) -> list[dict | None]:
        """Every recurrent layer's conv and recurrent states, flags and token count, copied (they are updated in
        place)."""
        return [None if not isinstance(layer, LinearAttentionCacheLayerMixin) else
                {name: copied(getattr(layer, name)) for name in RECURRENT_STATE if hasattr(layer, name)}
                for layer in self.cache.layers]


# A linear-attention cache layer's per-state dicts (transformers.cache_utils.LinearAttentionCacheLayerMixin) and,
# from transformers 5.25, the tokens it has seen (a tensor, which get_seq_length reads: positions follow it).
RECURRENT_STATE = ("conv_states", "recurrent_states", "is_conv_states_initialized", "is_recurrent_states_initialized",
                   "has_previous_state", "conv_kernel_size", "cumulative_length_linear")
ROLLBACK_PASSES = 64  # passes kept for rollback: a verification, or a self-drafting copy's k one-token steps


def copied(value):
    """A state of RECURRENT_STATE, copied: a tensor, or a dict of them (and of flags) per state index."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    return {i: t.clone() if isinstance(t, torch.Tensor) else t for i, t in value.items()}


class StaticSession:
    def __init__(self, target: FrozenTarget, max_len: int, slots: BatchSlots | None = None):
        model, c = target.model.model, target.config
        self.target, self.layers, self.length, self.slots = target, model.layers, 0, slots
        self.stacks = [layer_stacks(layer) for layer in self.layers]
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        param = next(model.parameters())
        batch = 1 if slots is None else len(slots)
        self.k = torch.zeros(len(self.layers), batch, kv_heads, max_len, self.head_dim, dtype=param.dtype, device=param.device)
        self.v = torch.zeros_like(self.k)
        # cos/sin of every position once, from the model's own rotary module (any RoPE scaling it has).
        cos, sin = model.rotary_emb(self.k, torch.arange(max_len, device=param.device)[None])
        self.cos, self.sin = cos[:, None], sin[:, None]  # [1, 1, max_len, head_dim]

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, tree: torch.Tensor | None = None,
                 depths: torch.Tensor | None = None, logits: str = "all") -> TargetOutput:
        """Run `tokens` [1, m] after the cache. A tree draft passes `tree` [m, m] (row i sees
        itself and its ancestors, inference.draft.Draft.tree_mask) and `depths` [m]
        (rotary positions start + depth); the default is a causal chain. `logits`: of "all" rows, or of the
        "last" (a prompt's prefill: lm_head over every prompt position would be a fifth of its work)."""
        model, start = self.target.model.model, self.length
        end = start + tokens.shape[1]
        if end > self.k.shape[3]:
            raise ValueError(f"the session's cache holds {self.k.shape[3]} positions; {end} needed")
        if self.slots is not None:
            cos, sin, visible = self.padded(start, end, tokens.device)
        elif tree is None:
            cos, sin = self.cos[:, :, start:end], self.sin[:, :, start:end]
            visible = torch.arange(end, device=tokens.device)[None] <= torch.arange(start, end, device=tokens.device)[:, None]
        else:
            cos, sin = self.cos[:, :, start + depths], self.sin[:, :, start + depths]
            visible = torch.cat([torch.ones(len(tree), start, dtype=torch.bool, device=tokens.device), tree], dim=1)
        x, aux = model.embed_tokens(tokens), {}
        for i, layer in enumerate(self.layers):
            aux[i] = x  # hidden_states[i]: the residual stream entering layer i
            x = x + self.attention(i, layer.self_attn, layer.input_layernorm(x), cos, sin, start, end, visible)
            x = x + self.mlp(layer.mlp, self.stacks[i][1], layer.post_attention_layernorm(x))
        self.length = end
        last = model.norm(x)
        # fp32 features, as FrozenTarget returns them: drafters compute in fp32 whatever the target's dtype.
        return TargetOutput(aux_hidden=[aux[k].float() for k in self.target.layer_ids], last_hidden=last.float(),
                            logits=self.target.model.lm_head(last if logits == "all" else last[:, -1:]).float())

    def padded(self, start: int, end: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, m, d] at each row's own positions and the mask [B, 1, m, end] of a batch."""
        positions = self.slots.positions(start, end).to(device)  # [B, m]
        cos, sin = self.cos[0, 0][positions][:, None], self.sin[0, 0][positions][:, None]
        return cos, sin, self.slots.visible(start, end).to(device)

    def select(self, index: torch.Tensor) -> None:
        """Keep the batch rows `index` (the prompts still decoding); the caller selects the slots."""
        self.k, self.v = self.k[:, index], self.v[:, index]

    def attention(self, i, attn, h, cos, sin, start, end, visible):
        B, m, _ = h.shape
        qkv = self.stacks[i][0]
        if qkv is None:
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        else:
            q, k, v = qkv(h).split([attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features], -1)
        q, k = q.view(B, m, -1, self.head_dim), k.view(B, m, -1, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3 normalises each head's q and k before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        self.k[i, :, :, start:end] = k
        self.v[i, :, :, start:end] = v.view(B, m, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, self.k[i, :, :, :end], self.v[i, :, :, :end], attn_mask=visible,
                                             scale=attn.scaling, enable_gqa=True)
        return attn.o_proj(out.transpose(1, 2).reshape(B, m, -1))

    @staticmethod
    def mlp(mlp, gate_up, h):
        if gate_up is None:
            return mlp(h)
        gate, up = gate_up(h).chunk(2, -1)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    def crop(self, length: int) -> None:
        self.length = length

    def keep(self, start: int, rows: list[int]) -> None:
        """After a tree pass that began at `start`: keep the cache rows start + rows (the
        accepted root-to-leaf path), moved to start, start + 1, ...; drop the rest."""
        if rows != list(range(len(rows))):
            index = torch.tensor(rows, device=self.k.device) + start
            self.k[:, :, :, start : start + len(rows)] = self.k[:, :, :, index]
            self.v[:, :, :, start : start + len(rows)] = self.v[:, :, :, index]
        self.length = start + len(rows)


# decoder layer -> (the tensors' addresses when stacked, (Q, K, V stacked or None, gate and up stacked or None))
_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def layer_stacks(layer: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """A decoder layer's Q, K and V projections, and its gate and up ones, each stacked into one matmul
    (speculators.quant.stack_linears: a step makes 4 matmul calls a layer instead of 7, 9% of a packed
    1-token pass of SmolLM2-135M, results/smollm2/stacked_projections/). Built once per layer, and again if
    its weights moved since (a dtype or device change gives them new storage)."""
    groups = ([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
              [layer.mlp.gate_proj, layer.mlp.up_proj])
    if layer not in _STACKS or _STACKS[layer][0] != addresses(groups):
        stacks = tuple(stack_linears(group) for group in groups)
        _STACKS[layer] = addresses(groups), stacks  # after stacking: the projections now read views
    return _STACKS[layer][1]


def addresses(groups) -> list[int]:
    return [t.data_ptr() for group in groups for linear in group
            for t in [*linear.parameters(recurse=False), *linear.buffers(recurse=False)]]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def open_session(target: FrozenTarget, max_len: int, slots: BatchSlots | None = None):
    """The static fast path for Llama-family targets without sliding windows, on one device; HF
    otherwise (its forward runs accelerate's hooks for a placed target). `slots` opens a batch
    session; None, a single sequence."""
    c = target.config
    windowed = getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True)
    if c.model_type in STATIC_MODEL_TYPES and not windowed and not target.placed:
        return StaticSession(target, max_len, slots)
    return RecurrentSession(target, slots) if target.recurrent else HFSession(target, slots)
