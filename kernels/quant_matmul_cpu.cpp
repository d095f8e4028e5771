// The CPU kernel of kernels/quant_matmul.py: y = x @ W^T for few rows of x (decoding, verification)
// with W read from its int8 or packed int4 storage, never materialised in fp32.
//
// Decoding a large model reads every weight once per token: the matmul is bound by memory
// bandwidth, so reading 0.5 (int4) or 1 (int8) byte per weight instead of 4 is the speed-up.
// Each output channel n is converted 16 weights at a time into two AVX2 registers and multiplied
// into a tile of rows of x (3 for int4, 4 for int8: more would spill registers); further tiles
// reread the channel's bytes from L1. Channels are split between threads, rows never are.
//
// int4 layout (kernels/quant_matmul.py): byte j of row n holds columns 2j (low nibble) and 2j+1
// (high nibble); W[n, k] = q * s[n, g] + (z[n, g] - 8 s[n, g]). Rather than interleave the
// nibbles, x is split once per call into its even and odd columns of each 16-column step, so the
// low nibbles of 8 bytes meet x's 8 even columns and the high nibbles its 8 odd ones.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <vector>

namespace {

constexpr int kStep = 16;  // weights converted per inner step
constexpr int kInt4RowTile = 3;  // rows of x sharing one converted step
constexpr int kInt8RowTile = 4;

float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// x [M, K] with each 16 columns reordered as 8 even, then 8 odd (-> split), and the sum of each
// group of columns (-> sums [M, K / group_size]), summed in order.
void split_and_sum(const float* x, int64_t M, int64_t K, int64_t group_size, float* split, float* sums) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    for (int64_t k = 0; k < K; k += kStep) {
      for (int j = 0; j < kStep / 2; ++j) {
        split[m * K + k + j] = row[k + 2 * j];
        split[m * K + k + kStep / 2 + j] = row[k + 2 * j + 1];
      }
    }
    for (int64_t g = 0; g < K / group_size; ++g) {
      float sum = 0;
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) sum += row[k];
      sums[m * (K / group_size) + g] = sum;
    }
  }
}

// sum_g (z[g] - 8 s[g]) x_sums[g], eight groups at a time.
float zero_point_term(const float* s, const float* z, const float* x_sums, int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  const __m256 eight = _mm256_set1_ps(8.0f);
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const __m256 offset = _mm256_fnmadd_ps(eight, _mm256_loadu_ps(s + g), _mm256_loadu_ps(z + g));
    acc = _mm256_fmadd_ps(offset, _mm256_loadu_ps(x_sums + g), acc);
  }
  float total = horizontal_sum(acc);
  for (; g < groups; ++g) total += (z[g] - 8.0f * s[g]) * x_sums[g];
  return total;
}

// Per group g: sum_k x[k] W[n, k] = s (sum_k x[k] q[k]) + (z - 8 s) (sum_k x[k]), so the inner loop
// multiplies x by the raw levels q and the scale is applied once per group; x_sums [M, K/g] holds
// the second sum.
template <int ROWS>
void int4_rows(const float* x, const float* x_sums, int64_t K, const uint8_t* q, const float* s, const float* z,
               int64_t group_size, float* out, int64_t out_stride) {
  const int64_t groups = K / group_size;
  __m256 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  const __m128i low_nibbles = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    __m256 dot[ROWS][2];  // two chains per row: each FMA waits for the previous one in its chain
    for (int r = 0; r < ROWS; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_ps();
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += kStep) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k / 2));
      const __m128i even = _mm_and_si128(bytes, low_nibbles);
      const __m128i odd = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibbles);
      const __m256 q_even = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(even));
      const __m256 q_odd = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(odd));
      for (int r = 0; r < ROWS; ++r) {
        dot[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), q_even, dot[r][0]);
        dot[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8), q_odd, dot[r][1]);
      }
    }
    const __m256 scale = _mm256_set1_ps(s[g]);
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_fmadd_ps(_mm256_add_ps(dot[r][0], dot[r][1]), scale, acc[r]);
  }
  for (int r = 0; r < ROWS; ++r) {  // after the loop: its registers are all taken
    out[r * out_stride] = horizontal_sum(acc[r]) + zero_point_term(s, z, x_sums + r * groups, groups);
  }
}

template <int ROWS>
void int8_rows(const float* x, int64_t K, const int8_t* q, float scale, float* out, int64_t out_stride) {
  __m256 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += kStep) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k));
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
    for (int r = 0; r < ROWS; ++r) {
      acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8), w1, acc[r][1]);
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r * out_stride] = scale * horizontal_sum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

// Calls fn(rows, m) over x's rows m.. in tiles of TILE rows, the rest in smaller tiles.
template <int TILE, typename Fn>
void over_row_tiles(int64_t M, Fn&& fn) {
  int64_t m = 0;
  for (; m + TILE <= M; m += TILE) fn(std::integral_constant<int, TILE>{}, m);
  if constexpr (TILE > 1) {
    if (m < M) over_row_tiles<TILE - 1>(M - m, [&](auto rows, int64_t r) { fn(rows, m + r); });
  }
}

// x [..., K] as fp32 [M, K] rows; checks what the kernels would otherwise misread.
at::Tensor rows_of(const at::Tensor& x, const at::Tensor& q, int64_t K) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "x: fp32 on the CPU");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K && K % kStep == 0, "x has ", x.size(-1), " features; the weight has K=", K,
              " (a multiple of ", kStep, " here)");
  TORCH_CHECK(q.is_contiguous(), "the weight must be contiguous");
  return x.reshape({-1, K}).contiguous();
}

// [M, N] -> x's leading dimensions, then N.
at::Tensor shaped_like(const at::Tensor& out, const at::Tensor& x) {
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end() - 1);
  sizes.push_back(out.size(1));
  return out.view(sizes);
}

at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& zeros, int64_t group_size) {
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  const at::Tensor xc = rows_of(x, packed, K);
  const int64_t M = xc.size(0);
  TORCH_CHECK(group_size > 0 && group_size % kStep == 0 && K % group_size == 0,
              "group_size must divide K and be a multiple of ", kStep);
  const int64_t groups = K / group_size;
  TORCH_CHECK(scales.numel() == N * groups && zeros.numel() == N * groups, "scales and zeros: [N, K / group_size]");
  const at::Tensor s = scales.to(at::kFloat).contiguous(), z = zeros.to(at::kFloat).contiguous();
  at::Tensor split = at::empty({M, K}, xc.options()), sums = at::empty({M, groups}, xc.options());
  split_and_sum(xc.data_ptr<float>(), M, K, group_size, split.data_ptr<float>(), sums.data_ptr<float>());
  at::Tensor out = at::empty({M, N}, xc.options());
  const float *xp = split.data_ptr<float>(), *xsp = sums.data_ptr<float>();
  const uint8_t* qp = packed.data_ptr<uint8_t>();
  const float *sp = s.data_ptr<float>(), *zp = z.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {  // each channel on one thread: no thread-dependent sums
    for (int64_t n = begin; n < end; ++n) {
      over_row_tiles<kInt4RowTile>(M, [&](auto rows, int64_t m) {
        int4_rows<decltype(rows)::value>(xp + m * K, xsp + m * groups, K, qp + n * K / 2, sp + n * groups,
                                         zp + n * groups, group_size, op + m * N + n, N);
      });
    }
  });
  return shaped_like(out, x);
}

at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  const int64_t N = qweight.size(0), K = qweight.size(1);
  const at::Tensor xc = rows_of(x, qweight, K);
  const int64_t M = xc.size(0);
  TORCH_CHECK(scales.numel() == N, "scales: [N]");
  const at::Tensor s = scales.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* qp = qweight.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      over_row_tiles<kInt8RowTile>(M, [&](auto rows, int64_t m) {
        int8_rows<decltype(rows)::value>(xp + m * K, K, qp + n * K, sp[n], op + m * N + n, N);
      });
    }
  });
  return shaped_like(out, x);
}

}  // namespace

TORCH_LIBRARY(speculators_forge, m) {
  m.def("int4_matmul(Tensor x, Tensor packed, Tensor scales, Tensor zeros, int group_size) -> Tensor");
  m.def("int8_matmul(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(speculators_forge, CPU, m) {
  m.impl("int4_matmul", &int4_matmul);
  m.impl("int8_matmul", &int8_matmul);
}
