"""gptq_int4, GPTQ (Frantar et al., 2022): int4 weights chosen to keep each layer's outputs, not its weights, close.

Round-to-nearest (quant=int4) picks every weight's level on its own. GPTQ quantizes a layer's input
columns one at a time and spreads each column's rounding error over the columns not yet quantized,
weighted by the inverse of H = X^T X, X the layer's inputs on calibration text, so that X W^T moves
as little as possible. The result is stored exactly like quant=int4 (same levels 0..15, scales and
zeros per group of `group_size` columns), so every int4 path serves it.

Choices here: one calibration pass through the full-precision model collects every layer's H at once
(the paper feeds each layer the outputs of the layers already quantized: more exact, one pass per
layer); a group gets its scale and zero when its first column is reached, so it sees the error spread
from the groups before it; dampening adds 1% of mean diag(H); columns in their natural order.
Calibration text: the first files of the stdlib corpus's train split (never its test split, which the
reports decode), cut into `sequences` pieces of CALIBRATION_LENGTH tokens.
"""

import torch
from torch import nn
from tqdm import tqdm

from common import corpus
from common.config import UserError
from speculators.quant.int4 import Int4Scheme
from speculators.quant.modules import WeightOnlyInt4Linear

CALIBRATION_LENGTH = 256
DAMPENING = 0.01
BLOCK = 128  # columns updated together (rounded to whole groups)


def calibration_ids(tokenizer, sequences: int) -> torch.Tensor:
    """[sequences, CALIBRATION_LENGTH] token ids of consecutive train-split files."""
    needed, ids = sequences * CALIBRATION_LENGTH, []
    for text in corpus.stdlib_files()["train"]["text"]:
        ids += tokenizer(text)["input_ids"]
        if len(ids) >= needed:
            return torch.tensor(ids[:needed]).view(sequences, CALIBRATION_LENGTH)
    raise UserError(f"quant.calibration_sequences={sequences}: the stdlib train split has only {len(ids)} tokens")


@torch.no_grad()
def input_hessians(model: nn.Module, layers: dict[str, nn.Linear], ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """name -> X^T X / rows over the inputs X [rows, K] each layer sees while the model reads `ids`."""
    sums = {name: torch.zeros(layer.in_features, layer.in_features) for name, layer in layers.items()}
    rows = dict.fromkeys(layers, 0)

    def accumulate(name):
        def hook(_, inputs):
            x = inputs[0].detach().reshape(-1, sums[name].shape[0]).float().cpu()
            sums[name] += x.T @ x
            rows[name] += x.shape[0]
        return hook

    hooks = [layer.register_forward_pre_hook(accumulate(name)) for name, layer in layers.items()]
    try:
        for batch in ids.split(8):
            model(batch.to(model.device))
    finally:
        for hook in hooks:
            hook.remove()
    return {name: sums[name] / max(rows[name], 1) for name in layers}


@torch.no_grad()
def gptq_int4(weight: torch.Tensor, hessian: torch.Tensor, group_size: int):
    """(q [N, K] in 0..15, scales [N, K/g], zeros [N, K/g]) in speculators.quant's int4 format."""
    W = weight.detach().float().cpu().clone()
    N, K = W.shape
    H = hessian.clone()
    unused = H.diagonal() == 0  # inputs that are always zero: any level will do
    H[unused, unused] = 1
    W[:, unused] = 0
    H.diagonal().add_(DAMPENING * H.diagonal().mean())
    # Upper Cholesky factor of H^-1: row i holds how column i's error moves the columns after it.
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    q = torch.zeros(N, K)
    scales, zeros = torch.zeros(N, K // group_size), torch.zeros(N, K // group_size)
    block = group_size * max(1, BLOCK // group_size)
    for start in range(0, K, block):
        end = min(start + block, K)
        Wb, Ub = W[:, start:end].clone(), U[start:end, start:end]
        errors = torch.zeros_like(Wb)
        for i in range(end - start):
            if (start + i) % group_size == 0:
                group = Wb[:, i:i + group_size]
                low = group.amin(1)
                step = (group.amax(1) - low).clamp(min=1e-12) / 15
                scales[:, (start + i) // group_size], zeros[:, (start + i) // group_size] = step, low + 8 * step
            level = torch.round((Wb[:, i] - low) / step).clamp(0, 15)
            q[:, start + i] = level
            errors[:, i] = (Wb[:, i] - (low + level * step)) / Ub[i, i]
            Wb[:, i:] -= errors[:, i, None] * Ub[i, i:]
        W[:, end:] -= errors @ U[start:end, end:]
    device = weight.device
    return q.to(device), scales.to(device), zeros.to(device)


class GptqInt4Scheme(Int4Scheme):
    name = "gptq_int4"

    def prepare(self, model, chosen, tokenizer):
        if tokenizer is None:
            raise UserError("quant.scheme=gptq_int4 needs the target's tokenizer for its calibration text")
        ids = calibration_ids(tokenizer, self.cfg.calibration_sequences)
        linears = {name: m for name, m in chosen if isinstance(m, nn.Linear)}
        hessians = input_hessians(model, linears, ids)
        self.levels = {name: gptq_int4(m.weight, hessians.pop(name), self.cfg.group_size)
                       for name, m in tqdm(linears.items(), desc="GPTQ", unit="layer")}

    def convert_table(self, name, weight):
        return super().convert(name, weight, None, cpu_matmul="dequantize")  # no inputs to calibrate on: round to nearest

    def convert(self, name, weight, bias, cpu_matmul):
        return WeightOnlyInt4Linear(weight, bias, self.cfg.group_size, cpu_matmul, self.levels.pop(name),
                                    self.cfg.int8_activations)
