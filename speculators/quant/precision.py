"""Which share of a target's weights each precision holds, experts apart: an "int8" MoE target whose
experts stayed fp32 is mostly fp32, and its memory and speed figures say so only beside this."""

import warnings
from collections import Counter

import torch
from torch import nn

from speculators.quant.experts import is_fused_expert

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
MOSTLY_UNQUANTIZED = 0.5  # above this share of weights left as loaded, quantize warns


def weight_counts(model: nn.Module, skip: frozenset = frozenset()) -> tuple[Counter, Counter]:
    """(weights per precision, of them in fused experts), counting each weight once (tied tables too), but not the
    parameters whose ids are in `skip`."""
    every, experts, seen = Counter(), Counter(), set(skip)
    for module in model.modules():
        precision = getattr(module, "precision", None)
        if precision is not None and id(module) not in seen:  # a quantized Linear or table (speculators.quant)
            seen.add(id(module))
            every[precision] += module.out_features * module.in_features
        for name in getattr(module, "int8_experts", ()):
            n = getattr(module, f"{name}_qweight").numel()
            every["int8"] += n
            experts["int8"] += n
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            label = DTYPE_NAMES.get(p.dtype, str(p.dtype).removeprefix("torch."))
            every[label] += p.numel()
            if is_fused_expert(module, p):
                experts[label] += p.numel()
    return every, experts


def precision_breakdown(model: nn.Module) -> dict[str, dict[str, float]]:
    """{precision: {"share": of all weights, "experts": of all weights, in fused experts}}, largest first."""
    every, experts = weight_counts(model)
    total = sum(every.values()) or 1
    return {label: {"share": n / total, "experts": experts[label] / total} for label, n in every.most_common()}


def describe(breakdown: dict[str, dict[str, float]]) -> str:
    """One line, e.g. "int8: 9% of weights; fp32: 91% (experts: 90%)"."""
    parts = []
    for i, (label, share) in enumerate(breakdown.items()):
        part = f"{label}: {percent(share['share'])}" + (" of weights" if i == 0 else "")
        parts.append(part + (f" (experts: {percent(share['experts'])})" if share["experts"] else ""))
    return "; ".join(parts)


def percent(x: float) -> str:
    return f"{x:.0%}" if x >= 0.01 or x == 0 else f"{x:.1%}"


def warn_if_mostly_unquantized(model: nn.Module, scheme: str) -> None:
    """One line at load when most of the decoder layers' weights kept the precision they were loaded in (the
    embeddings and lm_head stay so by choice: quant.quantize_embeddings, quant.quantize_lm_head)."""
    tables = frozenset(id(p) for table in (model.get_input_embeddings(), model.get_output_embeddings())
                       for p in table.parameters())
    tables |= {id(p) for p in model.parameters() if p.dim() < 2}  # norms and biases: never quantized
    every, _ = weight_counts(model, tables)
    kept = sum(n for label, n in every.items() if label in DTYPE_NAMES.values())
    if kept > MOSTLY_UNQUANTIZED * sum(every.values()):  # none without decoder layers (a target for a cache)
        warnings.warn(f"quant.scheme={scheme} left {percent(kept / sum(every.values()))} of the target's layer "
                      f"weights unquantized ({describe(precision_breakdown(model))}): its memory and speed are mostly "
                      f"those of the unquantized target", stacklevel=3)
