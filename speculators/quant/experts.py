"""Fused MoE expert weights (Qwen3-MoE, Llama-4, gpt-oss, DeepSeek-V3 in transformers 5): one 3-D
parameter [experts, out, in] (or [experts, in, out], `is_transposed`) per projection, read by the experts
module's own forward (bmm, grouped_mm, or a per-expert F.linear).

int8 stores each as int8 levels with one scale per expert and output channel, s = max |W| / 127 over
the input axis (the nn.Linear int8 rule, expert by expert), and dequantizes them into the module for
each forward (a hook), so whichever forward transformers dispatches to reads ordinary tensors. The
dequantized copy lives only during that forward: memory holds the int8 levels.
"""

import torch
from torch import nn


def fused_expert_weights(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, parameter name) of every fused expert weight."""
    return [(module, name) for module in model.modules()
            for name, p in module.named_parameters(recurse=False) if is_fused_expert(module, p)]


def is_fused_expert(module: nn.Module, weight: torch.Tensor) -> bool:
    """A 3-D weight of a model's own module: torch's (the state-space layers' Conv1d [C, 1, k]) are no experts."""
    return weight.dim() == 3 and not type(module).__module__.startswith("torch.")


def input_axis(module: nn.Module, name: str, weight: torch.Tensor) -> int:
    """The axis summed over in the product: transformers' `is_transposed` says it where set; Llama-4's experts
    (bmm, [E, in, out]) have none, so the hidden size tells (gate_up reads the hidden state, down writes it)."""
    transposed = getattr(module, "is_transposed", None)
    if transposed is None:
        hidden = getattr(module, "hidden_size", None) or getattr(module, "hidden_dim", None)
        transposed = weight.shape[1] == hidden if "down" not in name else weight.shape[2] == hidden
    return 1 if transposed else 2


def quantize_experts(model: nn.Module) -> int:
    """Replace every fused expert weight with int8 levels and scales; returns how many."""
    found = fused_expert_weights(model)
    for module, name in found:
        weight = module._parameters.pop(name).detach()
        axis = input_axis(module, name, weight)
        scales = weight.float().abs().amax(axis, keepdim=True).clamp(min=1e-12) / 127
        module.register_buffer(f"{name}_qweight", torch.round(weight.float() / scales).clamp(-127, 127).to(torch.int8))
        module.register_buffer(f"{name}_scales", scales)
        setattr(module, "int8_experts", [*getattr(module, "int8_experts", []), name])
        setattr(module, "experts_dtype", weight.dtype)
    for module in {id(m): m for m, _ in found}.values():
        module.register_forward_pre_hook(dequantize_into)
        module.register_forward_hook(drop_dequantized)
    return len(found)


def dequantize_into(module: nn.Module, args) -> None:
    for name in module.int8_experts:
        levels, scales = getattr(module, f"{name}_qweight"), getattr(module, f"{name}_scales")
        object.__setattr__(module, name, (levels.float() * scales).to(module.experts_dtype))


def drop_dequantized(module: nn.Module, args, output) -> None:
    for name in module.int8_experts:
        module.__dict__.pop(name, None)


def expert_weight(module: nn.Module, name: str) -> torch.Tensor:
    """The weight `name` of an experts module as its forward reads it (dequantized if stored int8)."""
    if name in getattr(module, "int8_experts", ()):
        return (getattr(module, f"{name}_qweight").float() * getattr(module, f"{name}_scales")).to(module.experts_dtype)
    return getattr(module, name)
