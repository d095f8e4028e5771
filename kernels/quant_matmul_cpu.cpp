// The CPU kernel of kernels/quant_matmul.py: y = x @ W^T for few rows of x (decoding, verification)
// with W read from its int8 (one scale per row, or per group of columns) or packed int4 storage,
// never materialised in fp32; and the same loop over fp32 weights (fp32_matmul, kernels.dense_matmul).
//
// Decoding a large model reads every weight once per token: the matmul is bound by memory
// bandwidth, so reading 0.5 (int4) or 1 (int8) byte per weight instead of 4 is the speed-up.
// Each output channel n is converted 16 weights at a time into two AVX2 registers and multiplied
// into a tile of rows of x (4 for int4 and int8, 3 for grouped int8: more would spill registers);
// further tiles reread the channel's bytes from L1. Channels are split between threads, rows never are.
// On AVX-512 CPUs the loops over fp32 x with int4, grouped int8 and fp32 weights run tiles of rows x channels
// (x loaded once for several channels) that give the AVX2 loops' bits.
//
// int4 layout (kernels/quant_matmul.py): byte j of row n holds columns 2j (low nibble) and 2j+1
// (high nibble); W[n, k] = q * s[n, g] + (z[n, g] - 8 s[n, g]). Rather than interleave the
// nibbles, x is split once per call into its even and odd columns of each 16-column step, so the
// low nibbles of 8 bytes meet x's 8 even columns and the high nibbles its 8 odd ones.
//
// The second half of the file is the int8-activation path (llama.cpp's arithmetic): x rounded to int8
// per block of 32 columns, then integer dot products with the stored levels (AVX-512 VNNI or AVX2).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <string>
#include <vector>

namespace {

constexpr int kStep = 16;  // weights converted per inner step
constexpr int kInt4RowTile = 4;  // rows of x sharing one converted step
constexpr int kInt8RowTile = 4;
constexpr int kInt8GroupRowTile = 3;  // a group's partial sums take two more registers per row
constexpr int kFp32RowTile = 6;  // 12 accumulators and the two weight registers of a step

float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The loops that multiply fp32 x (fp32, int4 and grouped int8 weights) in AVX-512 tiles, in this file built for AVX2.
#define AVX512 __attribute__((target("avx512f")))

// Lanes 0-7 plus lanes 8-15: the AVX-512 loops keep in one register what the AVX2 loops keep in two
// (columns k..k+8 and k+8..k+16 of each step) and add the halves where those add their two registers.
AVX512 inline __m256 halves_sum(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// Their instruction set; fp32_x_isa() may force AVX2 (tests, comparisons).
std::atomic<bool> fp32_x_avx512{__builtin_cpu_supports("avx512f") != 0};

// Weights are prefetched this many bytes ahead of each channel's loads (16 cache lines): with the hardware's
// prefetching alone, verifying 6 rows of an fp32 layer took 1.2-1.7x the time of decoding 1 with W coming
// from memory, with this 1.2-1.35x (SmolLM2-135M's layers, 1 thread, a regeneration job beside).
constexpr int64_t kPrefetchBytes = 1024;

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
  const __m256i low_nibbles = _mm256_set1_epi32(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    __m256 dot[ROWS][2];  // two chains per row: each FMA waits for the previous one in its chain
    for (int r = 0; r < ROWS; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_ps();
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += kStep) {
      // 8 bytes widened to 8 lanes first: then one mask and one shift split the nibbles of all 8
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k / 2)));
      const __m256 q_even = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low_nibbles));
      const __m256 q_odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
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

// int4_rows with AVX-512, in tiles of ROWS rows x COLS channels (as fp32_tile_avx512 below): a step's 8 even
// and 8 odd levels in one register, its lanes 0-7 int4_rows' dot[r][0] and lanes 8-15 its dot[r][1], summed
// in the same order, and each group's halves added as int4_rows adds them: the same bits on either
// instruction set, whatever the tile.
constexpr int kInt4RowsAvx512 = 6, kInt4ColsAvx512 = 2;  // 12 group sums, 12 accumulators, 2 levels, 1 of x

// Levels of 16 columns of one channel as fp32, for grouped_sums_avx512.
struct Int4Levels {  // packed int4: 8 bytes, low nibbles (even columns) then high ones (odd), as x is split
  const uint8_t* q;
  int64_t K;
  AVX512 __m512 operator()(int c, int64_t k) const {
    const uint8_t* bytes_at = q + c * (K / 2) + k / 2;
    _mm_prefetch(reinterpret_cast<const char*>(bytes_at) + kPrefetchBytes, _MM_HINT_T0);
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes_at));
    const __m128i low_nibbles = _mm_set1_epi8(0x0F);
    const __m128i even = _mm_and_si128(bytes, low_nibbles);
    const __m128i odd = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibbles);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(even, odd)));
  }
};

struct Int8Levels {  // int8: 16 bytes in column order
  const int8_t* q;
  int64_t K;
  AVX512 __m512 operator()(int c, int64_t k) const {
    const int8_t* bytes_at = q + c * K + k;
    _mm_prefetch(reinterpret_cast<const char*>(bytes_at) + kPrefetchBytes, _MM_HINT_T0);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes_at))));
  }
};

// acc[r][c] = sum over groups g of s[c, g] (sum over g's columns of x[r] * levels of channel c): the loop
// of int4_rows and int8_group_rows, one 16-lane register per step where they keep two of 8 lanes.
template <int ROWS, int COLS, typename Levels>
AVX512 inline void grouped_sums_avx512(const float* x, int64_t K, const float* s, int64_t group_size,
                                       const Levels& levels, __m256 (&acc)[ROWS][COLS]) {
  const int64_t groups = K / group_size;
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < COLS; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m512 dot[ROWS][COLS];
    for (int r = 0; r < ROWS; ++r) {
      for (int c = 0; c < COLS; ++c) dot[r][c] = _mm512_setzero_ps();
    }
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += kStep) {
      __m512 level[COLS];
      for (int c = 0; c < COLS; ++c) level[c] = levels(c, k);
      for (int r = 0; r < ROWS; ++r) {
        const __m512 row = _mm512_loadu_ps(x + r * K + k);
        for (int c = 0; c < COLS; ++c) dot[r][c] = _mm512_fmadd_ps(row, level[c], dot[r][c]);
      }
    }
    for (int c = 0; c < COLS; ++c) {
      const __m256 scale = _mm256_set1_ps(s[c * groups + g]);
      for (int r = 0; r < ROWS; ++r) acc[r][c] = _mm256_fmadd_ps(halves_sum(dot[r][c]), scale, acc[r][c]);
    }
  }
}

template <int ROWS, int COLS>
AVX512 void int4_tile_avx512(const float* x, const float* x_sums, int64_t K, const uint8_t* q, const float* s,
                             const float* z, int64_t group_size, float* out, int64_t out_stride) {
  const int64_t groups = K / group_size;
  __m256 acc[ROWS][COLS];
  grouped_sums_avx512<ROWS, COLS>(x, K, s, group_size, Int4Levels{q, K}, acc);
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < COLS; ++c) {
      out[r * out_stride + c] = horizontal_sum(acc[r][c]) +
                                zero_point_term(s + c * groups, z + c * groups, x_sums + r * groups, groups);
    }
  }
}

// acc[r] += x[r, k..k+16) * q[k..k+16) for each row r of the tile, in two chains per row (each FMA
// waits for the previous one in its chain).
template <int ROWS>
inline void int8_step(const float* x, int64_t K, const int8_t* q, int64_t k, __m256 (&acc)[ROWS][2]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k));
  const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
  for (int r = 0; r < ROWS; ++r) {
    acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), w0, acc[r][0]);
    acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8), w1, acc[r][1]);
  }
}

template <int ROWS>
void int8_rows(const float* x, int64_t K, const int8_t* q, float scale, float* out, int64_t out_stride) {
  __m256 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += kStep) int8_step<ROWS>(x, K, q, k, acc);
  for (int r = 0; r < ROWS; ++r) out[r * out_stride] = scale * horizontal_sum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

// One scale per group of columns: each group's dot product with the raw q, then times its scale.
template <int ROWS>
void int8_group_rows(const float* x, int64_t K, const int8_t* q, const float* s, int64_t group_size, float* out,
                     int64_t out_stride) {
  __m256 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < K / group_size; ++g) {
    __m256 dot[ROWS][2];
    for (int r = 0; r < ROWS; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_ps();
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += kStep) int8_step<ROWS>(x, K, q, k, dot);
    const __m256 scale = _mm256_set1_ps(s[g]);
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_fmadd_ps(_mm256_add_ps(dot[r][0], dot[r][1]), scale, acc[r]);
  }
  for (int r = 0; r < ROWS; ++r) out[r * out_stride] = horizontal_sum(acc[r]);
}

// int8_group_rows with AVX-512, in tiles of ROWS rows x COLS channels (GGUF's Q8_0 embedding and lm_head):
// grouped_sums_avx512 over its levels, with the same bits as int8_group_rows.
constexpr int kInt8GroupRowsAvx512 = 6, kInt8GroupColsAvx512 = 2;

template <int ROWS, int COLS>
AVX512 void int8_group_tile_avx512(const float* x, int64_t K, const int8_t* q, const float* s, int64_t group_size,
                                   float* out, int64_t out_stride) {
  __m256 acc[ROWS][COLS];
  grouped_sums_avx512<ROWS, COLS>(x, K, s, group_size, Int8Levels{q, K}, acc);
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < COLS; ++c) out[r * out_stride + c] = horizontal_sum(acc[r][c]);
  }
}

// fp32 weights (an unquantized layer, decoding): the same loop without a conversion, so one row is
// bound by reading W and each further row costs two FMAs per 16 weights, not another pass over W.
template <int ROWS>
void fp32_rows(const float* x, int64_t K, const float* w, float* out, int64_t out_stride) {
  __m256 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += kStep) {
    const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
    for (int r = 0; r < ROWS; ++r) {
      acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8), w1, acc[r][1]);
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r * out_stride] = horizontal_sum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

// The same sums with AVX-512, in tiles of ROWS rows x COLS channels: each row's 16 columns are loaded once
// for all COLS channels (AVX2's 16 registers cannot hold such a tile; its loop reloads x for every
// channel), so a verification of 6 rows costs little more than decoding 1. Lanes 0-7 of an accumulator are
// fp32_rows' acc[r][0], lanes 8-15 its acc[r][1], in the same order, and the end adds the halves as
// fp32_rows does: the same bits on either instruction set, whatever the tile.
constexpr int kFp32RowsAvx512 = 6, kFp32ColsAvx512 = 4;  // 24 accumulators, 4 weight registers, 1 of x

template <int ROWS, int COLS>
AVX512 void fp32_tile_avx512(const float* x, int64_t K, const float* w, float* out, int64_t out_stride) {
  __m512 acc[ROWS][COLS];
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; k += kStep) {
    __m512 weights[COLS];
    for (int c = 0; c < COLS; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(w + c * K + k) + kPrefetchBytes, _MM_HINT_T0);
      weights[c] = _mm512_loadu_ps(w + c * K + k);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512 row = _mm512_loadu_ps(x + r * K + k);
      for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_fmadd_ps(row, weights[c], acc[r][c]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < COLS; ++c) out[r * out_stride + c] = horizontal_sum(halves_sum(acc[r][c]));
  }
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

// Calls fn(rows, m, n) for every output channel n over x's rows in tiles of TILE. Each channel is summed
// on one thread, so no sum depends on the thread count.
template <int TILE, typename Fn>
void over_channels(int64_t M, int64_t N, Fn&& fn) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) over_row_tiles<TILE>(M, [&](auto rows, int64_t m) { fn(rows, m, n); });
  });
}

// Channels [begin, end) times every row of x, in tiles: COLS channels at a time, the rest one by one.
template <int ROWS, int COLS, typename Tile>
void over_tiles(int64_t M, int64_t begin, int64_t end, Tile&& tile) {
  int64_t n = begin;
  for (; n + COLS <= end; n += COLS) {
    over_row_tiles<ROWS>(M, [&](auto rows, int64_t m) { tile(rows, std::integral_constant<int, COLS>{}, m, n); });
  }
  for (; n < end; ++n) {
    over_row_tiles<ROWS>(M, [&](auto rows, int64_t m) { tile(rows, std::integral_constant<int, 1>{}, m, n); });
  }
}

// The operands of an int8-weight matmul with fp32 activations: out [M, N] and the pointers its kernels read.
struct Int8Operands {
  at::Tensor out, scales;
  const float* x;
  const int8_t* q;
  const float* s;
  float* o;
};

Int8Operands int8_operands(const at::Tensor& xc, const at::Tensor& qweight, const at::Tensor& scales, int64_t N) {
  Int8Operands ops{at::empty({xc.size(0), N}, xc.options()), scales.to(at::kFloat).contiguous()};
  ops.x = xc.data_ptr<float>();
  ops.q = qweight.data_ptr<int8_t>();
  ops.s = ops.scales.data_ptr<float>();
  ops.o = ops.out.data_ptr<float>();
  return ops;
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
  if (fp32_x_avx512.load()) {
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      over_tiles<kInt4RowsAvx512, kInt4ColsAvx512>(M, begin, end, [&](auto r, auto c, int64_t m, int64_t n) {
        int4_tile_avx512<decltype(r)::value, decltype(c)::value>(xp + m * K, xsp + m * groups, K, qp + n * K / 2,
                                                                 sp + n * groups, zp + n * groups, group_size,
                                                                 op + m * N + n, N);
      });
    });
  } else {
    over_channels<kInt4RowTile>(M, N, [&](auto rows, int64_t m, int64_t n) {
      int4_rows<decltype(rows)::value>(xp + m * K, xsp + m * groups, K, qp + n * K / 2, sp + n * groups,
                                       zp + n * groups, group_size, op + m * N + n, N);
    });
  }
  return shaped_like(out, x);
}

at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  const int64_t N = qweight.size(0), K = qweight.size(1);
  const at::Tensor xc = rows_of(x, qweight, K);
  const int64_t M = xc.size(0);
  TORCH_CHECK(scales.numel() == N, "scales: [N]");
  const Int8Operands ops = int8_operands(xc, qweight, scales, N);
  over_channels<kInt8RowTile>(M, N, [&](auto rows, int64_t m, int64_t n) {
    int8_rows<decltype(rows)::value>(ops.x + m * K, K, ops.q + n * K, ops.s[n], ops.o + m * N + n, N);
  });
  return shaped_like(ops.out, x);
}

at::Tensor int8_group_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             int64_t group_size) {
  const int64_t N = qweight.size(0), K = qweight.size(1);
  const at::Tensor xc = rows_of(x, qweight, K);
  const int64_t M = xc.size(0);
  TORCH_CHECK(group_size > 0 && group_size % kStep == 0 && K % group_size == 0,
              "group_size must divide K and be a multiple of ", kStep);
  const int64_t groups = K / group_size;
  TORCH_CHECK(scales.numel() == N * groups, "scales: [N, K / group_size]");
  const Int8Operands ops = int8_operands(xc, qweight, scales, N);
  if (fp32_x_avx512.load()) {
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      over_tiles<kInt8GroupRowsAvx512, kInt8GroupColsAvx512>(M, begin, end, [&](auto r, auto c, int64_t m, int64_t n) {
        int8_group_tile_avx512<decltype(r)::value, decltype(c)::value>(ops.x + m * K, K, ops.q + n * K,
                                                                       ops.s + n * groups, group_size, ops.o + m * N + n, N);
      });
    });
  } else {
    over_channels<kInt8GroupRowTile>(M, N, [&](auto rows, int64_t m, int64_t n) {
      int8_group_rows<decltype(rows)::value>(ops.x + m * K, K, ops.q + n * K, ops.s + n * groups, group_size,
                                             ops.o + m * N + n, N);
    });
  }
  return shaped_like(ops.out, x);
}


at::Tensor fp32_matmul(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "the weight must be fp32");
  const at::Tensor xc = rows_of(x, weight, K);
  const int64_t M = xc.size(0);
  at::Tensor out = at::empty({M, N}, xc.options());
  const float *xp = xc.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (fp32_x_avx512.load()) {
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      over_tiles<kFp32RowsAvx512, kFp32ColsAvx512>(M, begin, end, [&](auto r, auto c, int64_t m, int64_t n) {
        fp32_tile_avx512<decltype(r)::value, decltype(c)::value>(xp + m * K, K, wp + n * K, op + m * N + n, N);
      });
    });
  } else {
    over_channels<kFp32RowTile>(M, N, [&](auto rows, int64_t m, int64_t n) {
      fp32_rows<decltype(rows)::value>(xp + m * K, K, wp + n * K, op + m * N + n, N);
    });
  }
  return shaped_like(out, x);
}

// The instruction set of the loops that multiply fp32 x (fp32_matmul, int4_matmul, int8_group_matmul):
// "" asks; "avx2" forces the AVX2 loops (to test or compare them on an AVX-512 machine); "best" goes back
// to the best the CPU has.
std::string fp32_x_isa(const std::string& isa) {
  TORCH_CHECK(isa.empty() || isa == "avx2" || isa == "best", "fp32_x_isa: '', 'avx2' or 'best', got '", isa, "'");
  if (!isa.empty()) fp32_x_avx512.store(isa == "best" && __builtin_cpu_supports("avx512f"));
  return fp32_x_avx512.load() ? "avx512" : "avx2";
}

// --- int8 activations: llama.cpp's arithmetic (its Q4_1 x Q8_1 and Q8_0 x Q8_0 dot products) ------
//
// Each row of x is rounded per block of 32 columns to int8, as llama.cpp's quantize_row_q8_0/_q8_1 do:
// d_x = max|x_b| / 127, q_x = round(x * (1 / d_x)) (ties to even). Then per output channel, integer dot
// products of the stored levels with q_x, and one fp32 scale per block:
//   int4, W = q d + m (d = s, m = z - 8 s):  y = sum_b d_b d_x,b sum_k q q_x  +  sum_g m_g s_x,g,
//     s_x,g = sum_{b in g} d_x,b sum_k q_x: the zero term needs only the sum of x's levels;
//   int8, W = q s:                          y = sum_b s_b d_x,b sum_k q q_x.
// The integer sums are exact; rounding x is the one approximation (half a level: up to 1/254 of the
// block's largest |x|). Both operands being bytes, AVX-512 VNNI multiplies 64 pairs and adds them in
// fours into int32 lanes in one instruction (vpdpbusd, two blocks per register), AVX2 in two (vpmaddubsw
// then vpmaddwd, one block per register), where the fp32 path converts every weight to fp32 first.
// Each fp32 lane then accumulates its int32 partial sum times d_b d_x,b.
//
// A tile is ROWS rows of x times COLS output channels: a step unpacks COLS channels' bytes once for
// all ROWS rows and loads each row's bytes once for all COLS channels; the ROWS x COLS accumulators
// are independent chains (one row alone still has COLS of them to hide the FMA latency). Every
// (row, channel) accumulator goes through the same operations whatever the tile, so a row's result
// does not depend on the other rows nor on the threads; it does differ between the AVX-512 and AVX2
// variants (other lanes, other fp32 sums).

constexpr int64_t kBlock = 32;      // columns per activation block, and the unit of weight groups here
constexpr int64_t kBlockLanes = 8;  // int32 lanes holding one block's partial sums (4 products each)

enum class Isa { kAvx2, kAvx512Vnni };

Isa best_isa() {
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return avx512 ? Isa::kAvx512Vnni : Isa::kAvx2;
}

std::atomic<Isa> q8_isa{best_isa()};  // int8_dot_isa() may force AVX2 (tests, comparisons)

// How x's levels are laid out for the weights they meet.
enum class Layout {
  kInt4,    // int4: each block's columns as 0, 2, .., 30, 1, 3, .., 31 (its bytes' low, then high, nibbles)
  kSigned,  // int8, AVX2: columns in order, signed levels
  kBiased,  // int8, VNNI: columns in order, q_x + 128 as uint8 (vpdpbusd's unsigned operand)
};

// x [M, K] rounded per block (see above).
struct Q8Rows {
  std::vector<int8_t> q;  // [M, K] levels
  std::vector<float> d;   // [M, K / 32 * 8]: d_x of each block over its 8 lanes
  std::vector<float> s;   // [M, K / group_size]: s_x of each weight group (int4's zero term)
};

// max |x| of one block; NaN if a value is NaN (a plain max would skip it).
float block_amax(const float* x) {
  float amax = 0.0f;
  for (int64_t k = 0; k < kBlock; ++k) {
    const float a = std::fabs(x[k]);
    amax = (a > amax || std::isnan(a)) ? a : amax;
  }
  return amax;
}

Q8Rows quantize_rows(const float* x, int64_t M, int64_t K, int64_t group_size, Layout layout) {
  const int64_t blocks = K / kBlock, groups = K / group_size;
  Q8Rows rows{std::vector<int8_t>(M * K), std::vector<float>(M * blocks * kBlockLanes),
              std::vector<float>(M * groups, 0.0f)};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + m * K + b * kBlock;
      const float amax = block_amax(xb);
      const float d = std::isfinite(amax) ? amax / 127.0f : NAN;  // inf or NaN in x: NaN out, not 0
      const float inverse = d > 0.0f ? 1.0f / d : 0.0f;
      int8_t* qb = rows.q.data() + m * K + b * kBlock;
      int32_t sum = 0;
      for (int64_t k = 0; k < kBlock; ++k) {
        const int32_t level = static_cast<int32_t>(std::nearbyint(xb[k] * inverse));
        sum += level;
        const int64_t at = layout == Layout::kInt4 ? k / 2 + (k % 2) * kBlock / 2 : k;
        qb[at] = layout == Layout::kBiased ? static_cast<int8_t>(static_cast<uint8_t>(level + 128))
                                           : static_cast<int8_t>(level);
      }
      std::fill_n(rows.d.data() + (m * blocks + b) * kBlockLanes, kBlockLanes, d);
      rows.s[m * groups + b * kBlock / group_size] += d * static_cast<float>(sum);
    }
  }
  return rows;
}

// The rows of one tile: levels, lane scales and group sums, from row m of Q8Rows.
struct Q8Tile {
  const int8_t* q;
  const float* d;
  const float* sums;
  int64_t K, d_stride, groups;
};

// The channels of one tile, from channel n: stored bytes, scales per group (s [K / group_size] a channel),
// int4's zeros likewise (else null), and the group of each block of 32 columns (the same for all channels).
struct Q8Channels {
  const uint8_t* q;
  int64_t q_stride;
  const float* s;
  const float* z;
  const int32_t* group_of;
};

#define Q8_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

// AVX-512 weight formats, two blocks per step (HALF: the last, odd block alone, the upper lanes zero).
// load -> levels, and the value the int32 lanes start from; dot -> those lanes plus the block's products.
struct Int4Avx512 {
  static constexpr int64_t kBytes = kBlock / 2;  // stored bytes per block
  static constexpr bool kZeros = true;
  template <bool HALF>
  Q8_AVX512 static inline __m512i load(const uint8_t* q, __m512i* start) {
    // 128-bit lanes: block b's 16 bytes twice, then block b+1's twice; keep the low nibbles of the
    // first copy (even columns) and the high ones of the second (odd columns), as x's layout
    const __m512i spread = _mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0);
    const __m512i shifts = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
    const __m256i bytes = _mm256_maskz_loadu_epi8(HALF ? 0xFFFFu : 0xFFFFFFFFu, q);
    *start = _mm512_setzero_si512();
    const __m512i both = _mm512_permutexvar_epi64(spread, _mm512_castsi256_si512(bytes));
    return _mm512_and_si512(_mm512_srlv_epi64(both, shifts), _mm512_set1_epi8(0x0F));
  }
  Q8_AVX512 static inline __m512i dot(__m512i start, __m512i w, __m512i x) {
    return _mm512_dpbusd_epi32(start, w, x);  // unsigned levels 0..15 times signed q_x
  }
};

struct Int8Avx512 {
  static constexpr int64_t kBytes = kBlock;
  static constexpr bool kZeros = false;
  template <bool HALF>
  Q8_AVX512 static inline __m512i load(const uint8_t* q, __m512i* start) {
    const __m512i w = _mm512_maskz_loadu_epi8(HALF ? 0xFFFFFFFFull : ~0ull, q);
    // x arrives as q_x + 128 (unsigned): start each lane at -128 sum(w) so that it ends at sum(q_x w)
    const __m512i offset = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(char(0x80)), w);
    *start = _mm512_sub_epi32(_mm512_setzero_si512(), offset);
    return w;
  }
  Q8_AVX512 static inline __m512i dot(__m512i start, __m512i w, __m512i x) {
    return _mm512_dpbusd_epi32(start, x, w);
  }
};

// acc[r][c] += (int32 sums of blocks b, b+1 of row r with channel c) x d_b d_x,b over their lanes.
template <class Format, int ROWS, int COLS, bool HALF>
Q8_AVX512 inline void q8_step_avx512(const Q8Tile& x, const Q8Channels& w, int64_t b, __m512 (&acc)[ROWS][COLS]) {
  __m512i levels[COLS], start[COLS];
  __m512 dw[COLS];  // block b's scale over lanes 0-7, block b+1's over 8-15 (HALF: no block b+1, dx is 0 there)
  for (int c = 0; c < COLS; ++c) {
    levels[c] = Format::template load<HALF>(w.q + c * w.q_stride + b * Format::kBytes, &start[c]);
    const float* s = w.s + c * x.groups;
    dw[c] = _mm512_set1_ps(s[w.group_of[b]]);
    if (!HALF) dw[c] = _mm512_insertf32x8(dw[c], _mm256_set1_ps(s[w.group_of[b + 1]]), 1);
  }
  for (int r = 0; r < ROWS; ++r) {
    const __m512i q = _mm512_maskz_loadu_epi8(HALF ? 0xFFFFFFFFull : ~0ull, x.q + r * x.K + b * kBlock);
    const __m512 dx = _mm512_maskz_loadu_ps(HALF ? 0x00FF : 0xFFFF, x.d + r * x.d_stride + b * kBlockLanes);
    for (int c = 0; c < COLS; ++c) {
      const __m512 sums = _mm512_cvtepi32_ps(Format::dot(start[c], levels[c], q));
      acc[r][c] = _mm512_fmadd_ps(sums, _mm512_mul_ps(dw[c], dx), acc[r][c]);
    }
  }
}

// acc[r][c] += (z_g - 8 s_g) s_x,g for every group g, 16 groups per step: int4's zero term.
template <int ROWS, int COLS>
Q8_AVX512 inline void zero_terms_avx512(const Q8Tile& x, const Q8Channels& w, __m512 (&acc)[ROWS][COLS]) {
  const __m512 eight = _mm512_set1_ps(8.0f);
  for (int64_t g = 0; g < x.groups; g += 16) {
    const __mmask16 live = x.groups - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (x.groups - g)) - 1);
    __m512 m[COLS];
    for (int c = 0; c < COLS; ++c) {
      const __m512 s = _mm512_maskz_loadu_ps(live, w.s + c * x.groups + g);
      m[c] = _mm512_fnmadd_ps(eight, s, _mm512_maskz_loadu_ps(live, w.z + c * x.groups + g));
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512 sums = _mm512_maskz_loadu_ps(live, x.sums + r * x.groups + g);
      for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_fmadd_ps(m[c], sums, acc[r][c]);
    }
  }
}

template <class Format, int ROWS, int COLS>
Q8_AVX512 void q8_tile_avx512(const Q8Tile& x, const Q8Channels& w, float* out, int64_t out_stride) {
  const int64_t blocks = x.K / kBlock;
  __m512 acc[ROWS][COLS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) q8_step_avx512<Format, ROWS, COLS, false>(x, w, b, acc);
  if (b < blocks) q8_step_avx512<Format, ROWS, COLS, true>(x, w, b, acc);
  if constexpr (Format::kZeros) zero_terms_avx512<ROWS, COLS>(x, w, acc);
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) out[r * out_stride + c] = _mm512_reduce_add_ps(acc[r][c]);
}

// AVX2 weight formats, one block per step: products -> int16 sums of pairs (vpmaddubsw: unsigned x
// signed bytes; at most 2 x 128 x 127, no saturation), then vpmaddwd against ones adds those in pairs.
struct Int4Avx2 {
  static constexpr int64_t kBytes = kBlock / 2;
  static constexpr bool kZeros = true;
  static inline __m256i load(const uint8_t* q) {  // [low nibbles (even columns) | high (odd)], as x's layout
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i low = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
  }
  static inline __m256i products(__m256i w, __m256i x) { return _mm256_maddubs_epi16(w, x); }
};

struct Int8Avx2 {
  static constexpr int64_t kBytes = kBlock;
  static constexpr bool kZeros = false;
  static inline __m256i load(const uint8_t* q) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)); }
  // |w| (unsigned) times x with w's sign: w x with vpmaddubsw's unsigned first operand
  static inline __m256i products(__m256i w, __m256i x) {
    return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  }
};

template <int ROWS, int COLS>
inline void zero_terms_avx2(const Q8Tile& x, const Q8Channels& w, __m256 (&acc)[ROWS][COLS]) {
  const __m256 eight = _mm256_set1_ps(8.0f);
  for (int64_t g = 0; g < x.groups; g += 8) {
    const __m256i lanes = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(x.groups - g)), lanes);
    __m256 m[COLS];
    for (int c = 0; c < COLS; ++c) {
      const __m256 s = _mm256_maskload_ps(w.s + c * x.groups + g, live);
      m[c] = _mm256_fnmadd_ps(eight, s, _mm256_maskload_ps(w.z + c * x.groups + g, live));
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m256 sums = _mm256_maskload_ps(x.sums + r * x.groups + g, live);
      for (int c = 0; c < COLS; ++c) acc[r][c] = _mm256_fmadd_ps(m[c], sums, acc[r][c]);
    }
  }
}

template <class Format, int ROWS, int COLS>
void q8_tile_avx2(const Q8Tile& x, const Q8Channels& w, float* out, int64_t out_stride) {
  const int64_t blocks = x.K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[ROWS][COLS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i levels[COLS];
    __m256 dw[COLS];
    for (int c = 0; c < COLS; ++c) {
      levels[c] = Format::load(w.q + c * w.q_stride + b * Format::kBytes);
      dw[c] = _mm256_set1_ps(w.s[c * x.groups + w.group_of[b]]);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + r * x.K + b * kBlock));
      const __m256 dx = _mm256_loadu_ps(x.d + r * x.d_stride + b * kBlockLanes);
      for (int c = 0; c < COLS; ++c) {
        const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(Format::products(levels[c], q), ones));
        acc[r][c] = _mm256_fmadd_ps(sums, _mm256_mul_ps(dw[c], dx), acc[r][c]);
      }
    }
  }
  if constexpr (Format::kZeros) zero_terms_avx2<ROWS, COLS>(x, w, acc);
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) out[r * out_stride + c] = horizontal_sum(acc[r][c]);
}

// Tile shapes (rows x channels): enough independent accumulators to hide the FMA latency, few enough
// for the registers (AVX-512: 32, AVX2: 16).
constexpr int kQ8RowsAvx512 = 3, kQ8ColsAvx512 = 4;
constexpr int kQ8RowsAvx2 = 2, kQ8ColsAvx2 = 2;


// out [M, N] = x's rounded rows times channels [begin, end) of a weight format; `channels(n)` says
// where channel n's bytes and scales are.
template <class Avx512, class Avx2, typename Channels>
void q8_matmul(Isa isa, const Q8Rows& rows, int64_t M, int64_t K, int64_t groups, int64_t begin, int64_t end,
               Channels&& channels, float* out, int64_t N) {
  const int64_t d_stride = K / kBlock * kBlockLanes;
  auto tile_of = [&](int64_t m) {
    return Q8Tile{rows.q.data() + m * K, rows.d.data() + m * d_stride, rows.s.data() + m * groups, K, d_stride, groups};
  };
  if (isa == Isa::kAvx512Vnni) {
    over_tiles<kQ8RowsAvx512, kQ8ColsAvx512>(M, begin, end, [&](auto r, auto c, int64_t m, int64_t n) {
      q8_tile_avx512<Avx512, decltype(r)::value, decltype(c)::value>(tile_of(m), channels(n), out + m * N + n, N);
    });
  } else {
    over_tiles<kQ8RowsAvx2, kQ8ColsAvx2>(M, begin, end, [&](auto r, auto c, int64_t m, int64_t n) {
      q8_tile_avx2<Avx2, decltype(r)::value, decltype(c)::value>(tile_of(m), channels(n), out + m * N + n, N);
    });
  }
}

// The weight group of each block of 32 columns.
std::vector<int32_t> groups_of_blocks(int64_t K, int64_t group_size) {
  std::vector<int32_t> group_of(K / kBlock);
  for (int64_t b = 0; b < K / kBlock; ++b) group_of[b] = static_cast<int32_t>(b * kBlock / group_size);
  return group_of;
}

// x [..., K] as fp32 [M, K] rows for the int8-activation kernels, which take blocks of 32 columns.
at::Tensor q8_rows_of(const at::Tensor& x, const at::Tensor& q, int64_t K, int64_t group_size) {
  TORCH_CHECK(K % kBlock == 0 && group_size > 0 && group_size % kBlock == 0 && K % group_size == 0,
              "int8 activations: K and group_size multiples of ", kBlock, ", group_size dividing K; got K=", K,
              ", group_size=", group_size);
  return rows_of(x, q, K);
}

at::Tensor int4_matmul_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          const at::Tensor& zeros, int64_t group_size) {
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  const at::Tensor xc = q8_rows_of(x, packed, K, group_size);
  const int64_t M = xc.size(0), groups = K / group_size;
  TORCH_CHECK(scales.numel() == N * groups && zeros.numel() == N * groups, "scales and zeros: [N, K / group_size]");
  const at::Tensor s = scales.to(at::kFloat).contiguous(), z = zeros.to(at::kFloat).contiguous();
  const Isa isa = q8_isa.load();
  const Q8Rows rows = quantize_rows(xc.data_ptr<float>(), M, K, group_size, Layout::kInt4);
  at::Tensor out = at::empty({M, N}, xc.options());
  const uint8_t* qp = packed.data_ptr<uint8_t>();
  const float *sp = s.data_ptr<float>(), *zp = z.data_ptr<float>();
  const std::vector<int32_t> group_of = groups_of_blocks(K, group_size);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {  // each channel on one thread
    auto channels = [&](int64_t n) {
      return Q8Channels{qp + n * K / 2, K / 2, sp + n * groups, zp + n * groups, group_of.data()};
    };
    q8_matmul<Int4Avx512, Int4Avx2>(isa, rows, M, K, groups, begin, end, channels, out.data_ptr<float>(), N);
  });
  return shaped_like(out, x);
}

// group_size K: one scale per row (scales [N]).
at::Tensor int8_matmul_q8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          int64_t group_size) {
  const int64_t N = qweight.size(0), K = qweight.size(1);
  const at::Tensor xc = q8_rows_of(x, qweight, K, group_size);
  const int64_t M = xc.size(0), groups = K / group_size;
  TORCH_CHECK(scales.numel() == N * groups, "scales: [N, K / group_size]");
  const at::Tensor s = scales.to(at::kFloat).contiguous();
  const Isa isa = q8_isa.load();
  const Q8Rows rows = quantize_rows(xc.data_ptr<float>(), M, K, group_size,
                                    isa == Isa::kAvx512Vnni ? Layout::kBiased : Layout::kSigned);
  at::Tensor out = at::empty({M, N}, xc.options());
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qweight.data_ptr<int8_t>());
  const float* sp = s.data_ptr<float>();
  const std::vector<int32_t> group_of = groups_of_blocks(K, group_size);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    auto channels = [&](int64_t n) { return Q8Channels{qp + n * K, K, sp + n * groups, nullptr, group_of.data()}; };
    q8_matmul<Int8Avx512, Int8Avx2>(isa, rows, M, K, groups, begin, end, channels, out.data_ptr<float>(), N);
  });
  return shaped_like(out, x);
}

// The instruction set of the int8-activation kernels: "" asks; "avx2" forces the AVX2 variant (to test
// or compare it on an AVX-512 machine); "best" goes back to the best the CPU has.
std::string int8_dot_isa(const std::string& isa) {
  TORCH_CHECK(isa.empty() || isa == "avx2" || isa == "best", "int8_dot_isa: '', 'avx2' or 'best', got '", isa, "'");
  if (!isa.empty()) q8_isa.store(isa == "avx2" ? Isa::kAvx2 : best_isa());
  return q8_isa.load() == Isa::kAvx512Vnni ? "avx512_vnni" : "avx2";
}

}  // namespace

TORCH_LIBRARY(speculators_forge, m) {
  m.def("int4_matmul(Tensor x, Tensor packed, Tensor scales, Tensor zeros, int group_size) -> Tensor");
  m.def("int8_matmul(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
  m.def("int8_group_matmul(Tensor x, Tensor qweight, Tensor scales, int group_size) -> Tensor");
  m.def("int4_matmul_q8(Tensor x, Tensor packed, Tensor scales, Tensor zeros, int group_size) -> Tensor");
  m.def("int8_matmul_q8(Tensor x, Tensor qweight, Tensor scales, int group_size) -> Tensor");
  m.def("fp32_matmul(Tensor x, Tensor weight) -> Tensor");
  m.def("int8_dot_isa(str isa) -> str", &int8_dot_isa);  // no tensor to dispatch on: one implementation
  m.def("fp32_x_isa(str isa) -> str", &fp32_x_isa);
}

TORCH_LIBRARY_IMPL(speculators_forge, CPU, m) {
  m.impl("int4_matmul", &int4_matmul);
  m.impl("int8_matmul", &int8_matmul);
  m.impl("int8_group_matmul", &int8_group_matmul);
  m.impl("int4_matmul_q8", &int4_matmul_q8);
  m.impl("int8_matmul_q8", &int8_matmul_q8);
  m.impl("fp32_matmul", &fp32_matmul);
}

