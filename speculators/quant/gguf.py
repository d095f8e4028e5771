"""gguf: a GGUF file's own quantized tensors, in the formats of kernels/quant_matmul.py: the weights llama.cpp
serves, not a re-quantization of their fp32 copy. Every tensor the file stores quantized is served from its
blocks, embeddings and lm_head included (quantize_embeddings and quantize_lm_head do not apply); a tied
embedding and lm_head share one module.

Per tensor type (byte layouts as in gguf-py's gguf/quants.py):
- Q4_1: blocks of 32 input columns, each an fp16 scale d, an fp16 min m and 16 bytes of nibbles
  (byte j: column j in the low nibble, column j + 16 in the high one); value = d q + m, q in 0..15.
  Served as int4 in groups of 32 with s = d and z = m + 8 d (W = (q - 8) s + z). (q - 8) d is exact
  in fp32 (a 4-bit integer times an 11-bit significand), so wherever z is exact too, the one rounding
  of (q - 8) s + z gives fl(d q + m), gguf-py's dequantized value, bit for bit. z is inexact only
  where |m| is some 2^13 times 8 d or more: a tensor with such a block stays as loaded (fp32, which
  is that same dequantization), with a warning. SmolLM2-135M-Instruct.Q4_1.gguf has none in its
  3,317,760 blocks.
- Q8_0: blocks of 32: an fp16 scale d and 32 int8; value = d q (exact in fp32). Served as int8 with
  one scale per group of 32 columns.
- F32, F16 (norms): stay as loaded. Any other type in a layer quant=gguf packs is refused.

Names, HF module -> GGUF tensor (llama.cpp's): model.layers.N.self_attn.{q,k,v,o}_proj ->
blk.N.attn_{q,k,v,output}, model.layers.N.mlp.{gate,up,down}_proj -> blk.N.ffn_{gate,up,down},
model.embed_tokens -> token_embd, lm_head -> output, or token_embd when the file has no output
tensor (tied embeddings: transformers' rule in transformers/modeling_gguf_pytorch_utils.py).
llama.cpp's converter permutes the rows of Q and K in files of architecture "llama" (its rotary
layout) and transformers' loader permutes them back (LlamaTensorProcessor, same file). Blocks run
along the input dimension, so the same row permutation applied to q, scales and zeros gives the
weights of the converted folder (speculators/gguf_file.py) exactly.
"""

import re
import warnings
from pathlib import Path

import numpy as np
import torch

from common.config import UserError
from speculators import gguf_file
from speculators.quant.modules import WeightOnlyInt4Linear, WeightOnlyInt8Linear
from speculators.quant.scheme import Scheme

PACKED = ("Q4_1", "Q8_0")
UNQUANTIZED = ("F32", "F16")
BLOCK = 32  # input columns per Q4_1 / Q8_0 block
LINEARS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}


class GgufWeights:
    """The tensors of one GGUF file, looked up by the name of the HF module they load into."""

    def __init__(self, path: Path):
        self.path = path
        reader = gguf_file.read(path)
        self.tensors = {t.name: t for t in reader.tensors}
        self.architecture = gguf_file.field(reader, "general.architecture")
        heads = gguf_file.field(reader, f"{self.architecture}.attention.head_count")
        kv_heads = gguf_file.field(reader, f"{self.architecture}.attention.head_count_kv") or heads
        self.heads = {"attn_q": heads, "attn_k": kv_heads}

    def tensor_name(self, module: str) -> str:
        """The GGUF tensor HF module `module` loads from."""
        if module == "model.embed_tokens":
            return "token_embd.weight"
        if module == "lm_head":
            return "output.weight" if "output.weight" in self.tensors else "token_embd.weight"
        layer = re.fullmatch(r"model\.layers\.(\d+)\.(\w+\.\w+)", module)
        if layer is None or layer[2] not in LINEARS:
            raise UserError(f"quant.scheme=gguf: {module} has no GGUF tensor name here (served: the Llama-family "
                            f"linear layers, embeddings and lm_head); load {self.path.name} with quant.scheme=none")
        return f"blk.{layer[1]}.{LINEARS[layer[2]]}.weight"

    def check(self, module: str) -> None:
        """One line naming the tensor if it is missing or of a type quant=gguf does not serve."""
        name = self.tensor_name(module)
        if name not in self.tensors:
            raise UserError(f"quant.scheme=gguf: {self.path.name} has no tensor {name} (for {module})")
        kind = self.tensors[name].tensor_type.name
        if kind not in PACKED + UNQUANTIZED:
            raise UserError(f"quant.scheme=gguf: {name} in {self.path.name} is {kind}; served: {', '.join(PACKED)} "
                            f"packed, {', '.join(UNQUANTIZED)} unquantized; load it with quant.scheme=none")

    def levels(self, module: str) -> tuple[str, tuple] | None:
        """(type, levels) of the tensor `module` loads from: Q4_1 -> (q [N, K] in 0..15, scales, zeros
        [N, K/32]), Q8_0 -> (q int8 [N, K], scales [N, K/32]), rows in the HF order; None: it stays as
        loaded (F32, F16, or Q4_1 whose zeros are not exact in fp32)."""
        name = self.tensor_name(module)
        tensor = self.tensors[name]
        kind = tensor.tensor_type.name
        if kind in UNQUANTIZED:
            return None
        K, N = (int(n) for n in tensor.shape)  # ggml lists the innermost dimension first
        blocks = torch.from_numpy(np.array(tensor.data)).view(N, K // BLOCK, -1)  # a copy: the reader maps the file
        stored, inexact = q4_1(blocks) if kind == "Q4_1" else (q8_0(blocks), 0)
        if inexact:
            warnings.warn(f"{self.path.name}: {name} has {inexact} Q4_1 blocks whose zero m + 8 d is not exact in "
                          f"fp32; it stays as loaded (fp32) to keep its weights bit for bit")
            return None
        rows = self.row_order(name, N)
        return kind, stored if rows is None else tuple(t[rows] for t in stored)

    def row_order(self, name: str, rows: int) -> torch.Tensor | None:
        """transformers' reverse permutation of Q and K rows for llama files (module doc); None: as stored."""
        kind = name.split(".")[-2]  # blk.N.attn_q.weight -> attn_q
        if self.architecture != "llama" or kind not in self.heads:
            return None
        heads = self.heads[kind]
        return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 number at byte `start` of each block, as fp32 [N, K/32]."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).squeeze(-1).float()


def q4_1(blocks: torch.Tensor):
    """(q, s, z) of Q4_1 blocks [N, K/32, 20] in our int4 convention, and how many z are not exact."""
    d, m = fp16(blocks, 0), fp16(blocks, 2)
    nibbles = blocks[..., 4:]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).flatten(1)
    zeros = m + 8 * d
    inexact = int((zeros.double() != m.double() + 8 * d.double()).sum())  # fp64 holds the sum of two fp16 exactly
    return (q, d, zeros), inexact


def q8_0(blocks: torch.Tensor):
    """(q, s) of Q8_0 blocks [N, K/32, 34]."""
    return blocks[..., 2:].contiguous().view(torch.int8).flatten(1), fp16(blocks, 0)


class GgufScheme(Scheme):
    """The file's own blocks, one module per GGUF tensor: a tied embedding table and lm_head share theirs.
    None for a tensor that stays as loaded."""

    name = "gguf"
    activations = ("exact", "int8")
    from_file = True

    def __init__(self, cfg, gguf_file: Path | None = None):
        super().__init__(cfg)
        self.weights = GgufWeights(gguf_file)
        self.built = {}

    def check(self, name, width):
        self.weights.check(name)

    def convert(self, name, weight, bias, cpu_matmul):
        tensor = self.weights.tensor_name(name)
        if tensor not in self.built:
            self.built[tensor] = self.build(name, weight, bias, cpu_matmul)
        return self.built[tensor]

    def convert_table(self, name, weight):
        return self.convert(name, weight, None, self.cfg.cpu_matmul)  # the table a tied lm_head multiplies by

    def build(self, name, weight, bias, cpu_matmul):
        found = self.weights.levels(name)
        if found is None:
            return None
        kind, levels = found
        if kind == "Q4_1":
            return WeightOnlyInt4Linear(weight, bias, BLOCK, cpu_matmul, levels, self.cfg.int8_activations)
        return WeightOnlyInt8Linear(weight, bias, cpu_matmul, levels, self.cfg.int8_activations)
