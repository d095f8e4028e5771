"""Weight-only quantized matmul: y = x @ W^T with W stored as integers and fp32 scales.

Two weight formats (speculators.quant writes them):
- int8, one scale per output channel n:   W[n, k] = q[n, k] * s[n],  q int8 [N, K], s [N];
  or, with a `group_size`, one scale per group of input columns: W[n, k] = q[n, k] * s[n, g],
  s [N, K/group_size] (a GGUF file's Q8_0 blocks, speculators/quant/gguf.py).
- int4, one scale and zero per group of `group_size` input columns (g = k // group_size):
      W[n, k] = (q[n, k] - 8) * s[n, g] + z[n, g],  q in 0..15,
  two q per byte in `packed` uint8 [N, K/2]: column 2j in the low nibble, 2j+1 in the high one.
  z is the value of the mid-level q = 8 (the tinygemm convention PyTorch's int4 CPU op uses).

Three implementations of the same math:
- `quant_matmul_reference`: dequantize W to x's dtype, then one matmul. The oracle, and the CPU path
  for many rows (training batches, prefill), where one dense matmul amortises the dequantization (on the
  CPU one pass of dequantize_cpu.cpp, the bits of PyTorch's expression `dequantize_torch`).
- `quant_matmul_triton`: tiles of x times tiles of W dequantized in registers; W never exists in
  full precision outside the kernel. Accumulates in fp32.
- `quant_matmul_cpu`: quant_matmul_cpu.cpp, an AVX2 kernel for a few fp32 rows (decoding,
  verification) that reads the stored bytes and never materialises W: decoding is bound by memory
  bandwidth, and W is 4x (int8) or 5x (int4 with fp32 scales and zeros per 32) smaller than fp32.
  On AVX-512 CPUs its int4, grouped int8 and fp32 loops run tiles of rows x channels instead, with the same bits.
  Compiled on first use with torch.utils.cpp_extension (once per machine and source, kernels/build.py); where
  it cannot build (no compiler, no AVX2) the reference serves, with one warning.
`quant_matmul` picks one: Triton where `forge_kernels.use_triton` says so; else the CPU kernel for at most
CPU_KERNEL_MAX_ROWS rows if the caller allows it (cpu_kernel) and it applies; else the reference.
Each row of the CPU kernel's result is computed alone, in one fixed order: it does not depend on the
other rows of x (verifying k drafts gives the bits decoding one token would), nor on the threads.

int8 activations (`int8_activations=True`, llama.cpp's arithmetic): each block of 32 columns of each
row of x is first rounded to int8 levels with its own scale (`round_activation_blocks`), then every
path multiplies those values. The CPU kernel does it with integer dot products of x's levels and the
weights' (AVX-512 VNNI where the CPU has it, else AVX2) and one fp32 multiply-add per block: on
SmolLM2-135M's layers 1.9-2.5x faster than its fp32 path, which converts every weight to fp32 (1.2x
on the small 576 -> 192, 1.5x on the 49152-row lm_head; 1 and 6 rows, 1 thread, kernels/
bench_quant_matmul.py); the price is the rounding of x, half a level (1/254 of its block's largest |x|)
per value. K and the group size must then be multiples of 32.
"""

import functools
import warnings
from pathlib import Path

import torch
import triton
import triton.language as tl

from forge_kernels.build import load_library
from forge_kernels.dispatch import use_triton

# Up to this many rows the kernel beats dequantize + one dense matmul on our 2-core AVX2 CPU for every layer
# measured (results/pycode/quant_matmul_cpu.json: up to 64 rows on the shipped target's layers, 128+ on a 369M model's).
CPU_KERNEL_MAX_ROWS = 32
CPU_KERNEL_STEP = 16  # the kernel dequantizes 16 weights at a time: K and group sizes must be multiples
ACT_BLOCK = 32  # int8 activations: columns per block of x sharing one scale (llama.cpp's Q8_0); K and group sizes must be multiples


def quant_matmul(x, qweight, scales, zeros=None, group_size: int | None = None, cpu_kernel: bool = True,
                 int8_activations: bool = False):
    """x [..., K] times W^T -> [..., N]; int8 (zeros None; group_size None: one scale per row) or packed
    int4 weights, see the module doc. int8_activations: x rounded first (round_activation_blocks), which
    the CPU kernel does itself, with integer dot products."""
    if int8_activations:
        if not use_triton(x) and cpu_kernel and cpu_kernel_applies(x, group_size, int8_activations):
            return quant_matmul_cpu(x, qweight, scales, zeros, group_size, int8_activations)
        x = round_activation_blocks(x)
    if use_triton(x):
        return quant_matmul_triton(x, qweight, scales, zeros, group_size)
    if cpu_kernel and cpu_kernel_applies(x, group_size):
        return quant_matmul_cpu(x, qweight, scales, zeros, group_size)
    return quant_matmul_reference(x, qweight, scales, zeros, group_size)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> q [N, K] in 0..15 (low nibble first)."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15, K even -> uint8 [N, K/2]."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def round_activation_blocks(x: torch.Tensor) -> torch.Tensor:
    """x with each block of ACT_BLOCK columns of each row rounded to int8 levels (llama.cpp's Q8_0):
    d = max|x_block| / 127, q = round(x * (1 / d)) (ties to even), returned as q d. The CPU kernel
    multiplies these same q by the weights' integers."""
    blocks = x.float().unflatten(-1, (-1, ACT_BLOCK))
    d = blocks.abs().amax(-1, keepdim=True) / 127
    levels = torch.round(blocks * torch.where(d > 0, 1 / d, 0))
    return (levels * d).flatten(-2).to(x.dtype)


def round_to_nearest_int4(weight: torch.Tensor, group_size: int):
    """(q [N, K] in 0..15, scales, zeros [N, K/g]): each weight to its nearest level (module doc)."""
    N, K = weight.shape
    w = weight.detach().float().view(N, K // group_size, group_size)
    low, high = w.amin(-1), w.amax(-1)
    scales = (high - low).clamp(min=1e-12) / 15
    q = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 15).view(N, K)
    return q, scales, low + 8 * scales


def dequantize(qweight, scales, zeros=None, group_size: int | None = None) -> torch.Tensor:
    """The fp32 weight [N, K] the stored integers stand for: dequantize_torch's bits, in one pass of the CPU
    kernel's (dequantize_cpu.cpp) where it is built."""
    stored = torch.int8 if zeros is None else torch.uint8  # fp8 weights and others: PyTorch's expression
    if (qweight.device.type == "cpu" and qweight.dtype == stored and qweight.dim() == 2 and scales.dtype == torch.float32
            and (zeros is None or zeros.dtype == torch.float32) and cpu_ops() is not None):
        if zeros is None:
            return cpu_ops().int8_dequantize(qweight, scales, group_size or qweight.shape[1])
        return cpu_ops().int4_dequantize(qweight, scales, zeros, group_size)
    return dequantize_torch(qweight, scales, zeros, group_size)


def dequantize_torch(qweight, scales, zeros=None, group_size: int | None = None) -> torch.Tensor:
    """dequantize in PyTorch's operators: the definition, on any device."""
    if zeros is None and group_size is None:
        return qweight.float() * scales[:, None]
    if zeros is None:
        N, K = qweight.shape
        return (qweight.float().view(N, K // group_size, group_size) * scales[..., None]).view(N, K)
    q = unpack_int4(qweight).float()
    N, K = q.shape
    w = (q.view(N, K // group_size, group_size) - 8) * scales[..., None] + zeros[..., None]
    return w.view(N, K)


def quant_matmul_reference(x, qweight, scales, zeros=None, group_size: int | None = None):
    check_inputs(x, qweight, scales, zeros, group_size)
    return x @ dequantize(qweight, scales, zeros, group_size).to(x.dtype).T


def check_inputs(x, qweight, scales, zeros, group_size) -> None:
    """Raise ValueError naming the argument for anything the kernels would misread."""
    N = qweight.shape[0]
    if zeros is None:
        K = qweight.shape[1]
        if group_size is not None and (group_size < 1 or K % group_size):
            raise ValueError(f"int8 weights with group scales: a group_size dividing K={K}, got {group_size}")
        expected = (N,) if group_size is None else (N, K // group_size)
        if qweight.dtype != torch.int8 or scales.shape != expected:
            raise ValueError(f"int8 weights: qweight int8 [N, K] and scales {list(expected)}, got {qweight.dtype} "
                             f"{tuple(qweight.shape)} and {tuple(scales.shape)}")
    else:
        K = 2 * qweight.shape[1]
        if qweight.dtype != torch.uint8 or not group_size or K % group_size:
            raise ValueError(f"int4 weights: qweight uint8 [N, K/2] and a group_size dividing K, got "
                             f"{qweight.dtype} {tuple(qweight.shape)}, group_size={group_size}")
        if scales.shape != (N, K // group_size) or zeros.shape != scales.shape:
            raise ValueError(f"int4 scales and zeros must be [N, K/group_size] = [{N}, {K // group_size}], "
                             f"got {tuple(scales.shape)} and {tuple(zeros.shape)}")
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features but the weight has K={K}")


# --- CPU path ----------------------------------------------------------------------------------


def cpu_kernel_applies(x: torch.Tensor, group_size: int | None, int8_activations: bool = False,
                       max_rows: int = CPU_KERNEL_MAX_ROWS) -> bool:
    rows = x.numel() // max(x.shape[-1], 1)
    step = ACT_BLOCK if int8_activations else CPU_KERNEL_STEP
    return (x.device.type == "cpu" and x.dtype == torch.float32 and rows <= max_rows
            and x.shape[-1] % step == 0 and (group_size is None or group_size % step == 0)
            and cpu_ops() is not None)


def quant_matmul_cpu(x, qweight, scales, zeros=None, group_size: int | None = None, int8_activations: bool = False):
    # The kernel checks its inputs; check_inputs only words its complaint (its 10 us would be a
    # quarter of a small layer's call).
    try:
        if int8_activations and zeros is None:  # group_size K: the one scale per row
            return cpu_ops().int8_matmul_q8(x, qweight, scales, group_size or qweight.shape[1])
        if int8_activations:
            return cpu_ops().int4_matmul_q8(x, qweight, scales, zeros, group_size)
        if zeros is None and group_size is None:
            return cpu_ops().int8_matmul(x, qweight, scales)
        if zeros is None:
            return cpu_ops().int8_group_matmul(x, qweight, scales, group_size)
        return cpu_ops().int4_matmul(x, qweight, scales, zeros, group_size)
    except RuntimeError:
        check_inputs(x, qweight, scales, zeros, group_size)
        raise


# fp32 weights: up to this many rows the kernel's single pass over W beats F.linear on SmolLM2-135M's
# layers with the weights coming from memory, as in decoding, per instruction set of its loop (AVX2:
# results/smollm2/quant_matmul_cpu_stream.json, 1.4-4.4x at 1-2 rows, most layers still ahead at 6, behind
# at 16; AVX-512 tiles: results/smollm2/fp32_x_kernels_stream.json, level at 1 row, 1.2-1.7x at 6-8, ahead or
# level up to 32).
DENSE_KERNEL_MAX_ROWS = {"avx2": 6, "avx512": 32}


def dense_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for an unquantized weight. For at most dense_kernel_max_rows() fp32 rows on
    the CPU without autograd (decoding, verification) it runs the CPU kernel's fp32_matmul, which reads
    W once for all rows and computes each row alone in one fixed order: a verification pass gives the
    bits one-token decoding gives. Anything else is F.linear."""
    if (weight.dtype == torch.float32 and weight.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and cpu_kernel_applies(x, None, max_rows=dense_kernel_max_rows())):
        out = cpu_ops().fp32_matmul(x, weight)
        return out if bias is None else out + bias
    return torch.nn.functional.linear(x, weight, bias)


@functools.cache
def dense_kernel_max_rows() -> int:
    """DENSE_KERNEL_MAX_ROWS for the instruction set the fp32 loop runs in on this CPU (0: no kernel)."""
    return DENSE_KERNEL_MAX_ROWS[cpu_ops().fp32_x_isa("")] if cpu_ops() is not None else 0


# (name, sources, cflags, ldflags). -ffp-contract=off: no multiply-add fused unless written so, as the
# torch references compute.
CPU_KERNEL_BUILD = ("speculators_forge_cpu", (Path(__file__).with_name("quant_matmul_cpu.cpp"),
                                               Path(__file__).with_name("dequantize_cpu.cpp")),
                    ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"), ("-fopenmp",))


@functools.cache
def cpu_ops():
    """The compiled kernel's ops (torch.ops.speculators_forge), or None where it cannot build."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    try:
        load_library(*CPU_KERNEL_BUILD, purpose="the CPU int8/int4 matmul")
    except Exception as error:  # no compiler, no headers: the reference still computes the same thing
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        warnings.warn(f"the CPU quantized-matmul kernel did not build ({first_line}); using dequantize + matmul")
        return None
    return torch.ops.speculators_forge


# --- Triton path -----------------------------------------------------------------------------


def quant_matmul_triton(x, qweight, scales, zeros=None, group_size: int | None = None,
                        block_m: int = 16, block_n: int = 32, block_k: int = 32):
    check_inputs(x, qweight, scales, zeros, group_size)
    N, K = qweight.shape[0], x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    int4 = zeros is not None
    group = group_size or K  # int8 with one scale per row: a single group
    scales2 = scales.reshape(N, -1).float()
    zeros2 = zeros.float() if int4 else scales2  # unread for int8
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _quant_matmul_kernel[grid](x2, qweight, scales2, zeros2, out, M, N, K, group,
                               x2.stride(0), x2.stride(1), qweight.stride(0), scales2.stride(0),
                               INT4=int4, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out.to(x.dtype).view(*x.shape[:-1], N)


@triton.jit
def _quant_matmul_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, M, N, K, group, x_sm, x_sk, q_sn, s_sn,
                         INT4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[m, n] = sum_k x[m, k] W[n, k], W dequantized a [BLOCK_K, BLOCK_N] tile at a time.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * x_sm + ks[None, :] * x_sk,
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0).to(tl.float32)
        ok = (ks[:, None] < K) & (cols[None, :] < N)
        g = ks[:, None] // group
        s = tl.load(s_ptr + cols[None, :] * s_sn + g, mask=ok, other=0.0)
        if INT4:
            byte = tl.load(q_ptr + cols[None, :] * q_sn + ks[:, None] // 2, mask=ok, other=0).to(tl.int32)
            q = (byte >> ((ks[:, None] % 2) * 4)) & 15
            z = tl.load(z_ptr + cols[None, :] * s_sn + g, mask=ok, other=0.0)
            w = (q.to(tl.float32) - 8.0) * s + z
        else:
            w = tl.load(q_ptr + cols[None, :] * q_sn + ks[:, None], mask=ok, other=0).to(tl.float32) * s
        acc += tl.dot(x, w)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc, mask=(rows[:, None] < M) & (cols[None, :] < N))
