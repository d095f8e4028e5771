"""Weight-only quantized matmul: y = x @ W^T with W stored as integers and fp32 scales.

Two weight formats (speculators.quant writes them):
- int8, one scale per output channel n:   W[n, k] = q[n, k] * s[n],  q int8 [N, K], s [N].
- int4, one scale and zero per group of `group_size` input columns (g = k // group_size):
      W[n, k] = (q[n, k] - 8) * s[n, g] + z[n, g],  q in 0..15,
  two q per byte in `packed` uint8 [N, K/2]: column 2j in the low nibble, 2j+1 in the high one.
  z is the value of the mid-level q = 8 (the tinygemm convention PyTorch's int4 CPU op uses).

Three implementations of the same math:
- `quant_matmul_reference`: dequantize W to x's dtype, then one matmul. The oracle, and the CPU path
  for many rows (training batches, prefill), where one dense matmul amortises the dequantization.
- `quant_matmul_triton`: tiles of x times tiles of W dequantized in registers; W never exists in
  full precision outside the kernel. Accumulates in fp32.
- `quant_matmul_cpu`: quant_matmul_cpu.cpp, an AVX2 kernel for a few fp32 rows (decoding,
  verification) that reads the stored bytes and never materialises W: decoding is bound by memory
  bandwidth, and W is 4x (int8) or 5x (int4 with fp32 scales and zeros per 32) smaller than fp32.
  Compiled on first use with torch.utils.cpp_extension (once per machine, cached); where it cannot
  build (no compiler, no AVX2) the reference serves, with one warning.
`quant_matmul` picks one: Triton where `kernels.use_triton` says so; else the CPU kernel for at most
CPU_KERNEL_MAX_ROWS rows if the caller allows it (cpu_kernel) and it applies; else the reference.
Each row of the CPU kernel's result is computed alone, in one fixed order: it does not depend on the
other rows of x (verifying k drafts gives the bits decoding one token would), nor on the threads.
"""

import functools
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels import use_triton

# Up to this many rows the kernel beats dequantize + one dense matmul on our 2-core AVX2 CPU for every layer
# measured (kernels/results/quant_matmul_cpu.json: up to 64 rows on the shipped target's layers, 128+ on a 369M model's).
CPU_KERNEL_MAX_ROWS = 32
CPU_KERNEL_STEP = 16  # the kernel dequantizes 16 weights at a time: K and int4 group sizes must be multiples


def quant_matmul(x, qweight, scales, zeros=None, group_size: int | None = None, cpu_kernel: bool = True):
    """x [..., K] times W^T -> [..., N]; int8 (zeros None) or packed int4 weights, see the module doc."""
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


def dequantize(qweight, scales, zeros=None, group_size: int | None = None) -> torch.Tensor:
    """The fp32 weight [N, K] the stored integers stand for."""
    if zeros is None:
        return qweight.float() * scales[:, None]
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
        if qweight.dtype != torch.int8 or scales.shape != (N,):
            raise ValueError(f"int8 weights: qweight int8 [N, K] and scales [N], got {qweight.dtype} "
                             f"{tuple(qweight.shape)} and {tuple(scales.shape)}")
        K = qweight.shape[1]
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


def cpu_kernel_applies(x: torch.Tensor, group_size: int | None) -> bool:
    rows = x.numel() // max(x.shape[-1], 1)
    return (x.device.type == "cpu" and x.dtype == torch.float32 and rows <= CPU_KERNEL_MAX_ROWS
            and x.shape[-1] % CPU_KERNEL_STEP == 0 and (group_size is None or group_size % CPU_KERNEL_STEP == 0)
            and cpu_ops() is not None)


def quant_matmul_cpu(x, qweight, scales, zeros=None, group_size: int | None = None):
    # The kernel checks its inputs; check_inputs only words its complaint (its 10 us would be a
    # quarter of a small layer's call).
    try:
        if zeros is None:
            return cpu_ops().int8_matmul(x, qweight, scales)
        return cpu_ops().int4_matmul(x, qweight, scales, zeros, group_size)
    except RuntimeError:
        check_inputs(x, qweight, scales, zeros, group_size)
        raise


@functools.cache
def cpu_ops():
    """The compiled kernel's ops (torch.ops.speculators_forge), or None where it cannot build."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    source = Path(__file__).with_name("quant_matmul_cpu.cpp")
    build = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions")) / "speculators_forge_cpu"
    build.mkdir(parents=True, exist_ok=True)
    lock = build / "lock"  # left behind by a build that was killed; torch would wait on it forever
    if lock.exists() and time.time() - lock.stat().st_mtime > 600:
        lock.unlink()
    if not (build / "speculators_forge_cpu.so").exists():
        print(f"compiling {source.name} for the CPU int8/int4 matmul (once per machine) in {build}", file=sys.stderr)
    from torch.utils.cpp_extension import load
    try:
        load(name="speculators_forge_cpu", sources=[str(source)], build_directory=str(build), is_python_module=False,
             extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"])
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
    group = group_size if int4 else K
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
