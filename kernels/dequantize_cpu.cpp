// The weights of kernels/quant_matmul.py's reference path (many rows: a prompt's prefill, a training batch),
// where one dense matmul follows: the fp32 weight [N, K] the stored integers stand for, in one pass.
//   packed int4: (q - 8) * s[n, g] + z[n, g]      int8: q * s[n, g] (group_size K: one scale per row)
// Each product and sum is rounded on its own (built with -ffp-contract=off), as quant_matmul.dequantize_torch
// computes them: the same bits. That expression makes five passes over [N, K]; on SmolLM2-135M's layers at a
// 200-token prefill they took longer than the matmul they feed.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {

// Groups of columns per task: a few thousand weights, so small layers still split between threads.
constexpr int64_t kGroupsPerTask = 64;

at::Tensor int4_dequantize(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros,
                           int64_t group_size) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2, "packed: uint8 [N, K/2]");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(group_size > 0 && group_size % 2 == 0 && K % group_size == 0, "group_size: even, dividing K=", K);
  const int64_t groups = N * (K / group_size);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && zeros.scalar_type() == at::kFloat && scales.numel() == groups &&
                  zeros.numel() == groups, "scales and zeros: fp32 [N, K / group_size]");
  const at::Tensor q = packed.contiguous(), s = scales.contiguous(), z = zeros.contiguous();
  at::Tensor out = at::empty({N, K}, s.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float *sp = s.data_ptr<float>(), *zp = z.data_ptr<float>();
  float* wp = out.data_ptr<float>();
  at::parallel_for(0, groups, kGroupsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {  // groups follow each other along rows: group g's bytes start at g * group_size / 2
      const uint8_t* bytes = qp + g * group_size / 2;
      float* w = wp + g * group_size;
      const float scale = sp[g], zero = zp[g];
      for (int64_t j = 0; j < group_size / 2; ++j) {  // column 2j in the low nibble, 2j + 1 in the high one
        w[2 * j] = (static_cast<float>(bytes[j] & 15) - 8.0f) * scale + zero;
        w[2 * j + 1] = (static_cast<float>(bytes[j] >> 4) - 8.0f) * scale + zero;
      }
    }
  });
  return out;
}

at::Tensor int8_dequantize(const at::Tensor& qweight, const at::Tensor& scales, int64_t group_size) {
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 2, "qweight: int8 [N, K]");
  const int64_t N = qweight.size(0), K = qweight.size(1);
  TORCH_CHECK(group_size > 0 && K % group_size == 0, "group_size must divide K=", K);
  const int64_t groups = N * (K / group_size);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == groups, "scales: fp32 [N, K / group_size]");
  const at::Tensor q = qweight.contiguous(), s = scales.contiguous();
  at::Tensor out = at::empty({N, K}, s.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  float* wp = out.data_ptr<float>();
  at::parallel_for(0, groups, kGroupsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const float scale = sp[g];
      for (int64_t j = g * group_size; j < (g + 1) * group_size; ++j) wp[j] = static_cast<float>(qp[j]) * scale;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(speculators_forge, m) {
  m.def("int4_dequantize(Tensor packed, Tensor scales, Tensor zeros, int group_size) -> Tensor");
  m.def("int8_dequantize(Tensor qweight, Tensor scales, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(speculators_forge, CPU, m) {
  m.impl("int4_dequantize", &int4_dequantize);
  m.impl("int8_dequantize", &int8_dequantize);
}
