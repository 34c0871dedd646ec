// Quantized-weight GEMV/GEMM with int8 activations over weights interleaved in tiles of 16
// output features (AVX-512 VNNI), CPU.
//
// qgemv.cpp's qgemv_q8 reads one weight row per output feature and reduces each block's
// 16 int32 lanes to one value with a float scale per pair of blocks: ~13 instructions per
// 64 weight bytes. Here the weights of 16 output features are interleaved once at load so
// that one 512-bit register holds 4 consecutive levels of one block for each of the 16:
//   Q8_0  packed [T, B, 8, 16, 4] uint8 = w + 128   (T = N/16 tiles, B = K/32 blocks)
//   Q4    packed [T, B, 4, 16, 4] uint8: the 16 GGUF bytes of a block (byte j: element j
//         low nibble, j + 16 high) in groups of 4 bytes
//   scales (and mins) [T, B, 16] per block (a group wider than 32 repeated), float32, or
//         float16 where every value is exactly a float16 (GGUF's own scales): 2 bytes
//         less a block and feature, 17% of a Q4_1 tile's bytes
// and vpdpbusd with the activations' 4 bytes broadcast accumulates the block's dot for
// all 16 features in one register: 8 (Q8) or 8 (Q4, two nibble halves) vpdpbusd, one
// int32 -> float conversion and one fma per block and tile. The int32 dot is exact:
//   Q8:  sum (w + 128) x = sum w x + 128 sum x, the accumulator starts at -128 sum x
//        (the activation block's level sum, shared by every feature);
//   Q4:  sum u x directly (u in 0..15 unsigned, x signed).
// Then y[r, n] = sum_b s[n, b] * d[r, b] * dot_b (+ m[n, b] * sx[r, b]): the numbers of
// qgemv_q8 (the same activation blocks, q8_blocks.h) up to the float32 summation order.
//
// x [M, K] float32; y [M, N]. Rows in fours reuse each loaded weight register; parallel over
// tiles with at::parallel_for, single-threaded below ~64 KiB of weights per task.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "q8_blocks.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kTiled = true;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 float16 values, exactly widened
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i bcast4(const int8_t* p) {  // 4 activation bytes in every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// MR rows of activations against one tile of 16 output features.
//   wt: the tile's levels (B blocks of kBlock bytes); st, mt: [B, 16] scales and mins
//   xq: row r0's levels (row stride K), xd/sx/xs: row r0's block scales, Q8_1 sums and
//   -128 * level sums (row stride B); out: MR x 16 floats.
template <int MR, bool Q4, class S>
void tile(int64_t B, int64_t K, const uint8_t* wt, const S* st, const S* mt,
          const int8_t* xq, const float* xd, const float* sx, const int32_t* xs, float* out) {
  constexpr int64_t kBlock = Q4 ? 256 : 512;
  __m512 y[MR];
  for (int r = 0; r < MR; ++r) y[r] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* w = wt + b * kBlock;
    for (int64_t l = 0; l < kBlock; l += 64)  // the next tile's bytes, ~4 KiB ahead
      _mm_prefetch(reinterpret_cast<const char*>(w + l + 4096), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(st + b * 16 + 256), _MM_HINT_T0);
    __m512i acc[MR], acc2[MR];
    for (int r = 0; r < MR; ++r) {
      acc[r] = Q4 ? _mm512_setzero_si512() : _mm512_set1_epi32(xs[r * B + b]);
      acc2[r] = _mm512_setzero_si512();  // a second chain: vpdpbusd's latency
    }
    if constexpr (Q4) {
      for (int g = 0; g < 4; ++g) {
        const __m512i v = _mm512_loadu_si512(w + g * 64);
        const __m512i lo = _mm512_and_si512(v, nib);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        for (int r = 0; r < MR; ++r) {
          const int8_t* x = xq + r * K + b * 32;
          acc[r] = _mm512_dpbusd_epi32(acc[r], lo, bcast4(x + 4 * g));
          acc2[r] = _mm512_dpbusd_epi32(acc2[r], hi, bcast4(x + 16 + 4 * g));
        }
      }
    } else {
      for (int g = 0; g < 8; g += 2) {
        const __m512i v0 = _mm512_loadu_si512(w + g * 64);
        const __m512i v1 = _mm512_loadu_si512(w + g * 64 + 64);
        for (int r = 0; r < MR; ++r) {
          const int8_t* x = xq + r * K + b * 32;
          acc[r] = _mm512_dpbusd_epi32(acc[r], v0, bcast4(x + 4 * g));
          acc2[r] = _mm512_dpbusd_epi32(acc2[r], v1, bcast4(x + 4 * g + 4));
        }
      }
    }
    const __m512 s = load16(st + b * 16);
    for (int r = 0; r < MR; ++r) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(acc[r], acc2[r]));
      y[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s, _mm512_set1_ps(xd[r * B + b])), y[r]);
    }
    if constexpr (Q4) {
      const __m512 m = load16(mt + b * 16);
      for (int r = 0; r < MR; ++r) y[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * B + b]), y[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * 16, y[r]);
}

template <bool Q4, class S>
void run_tiles(int64_t M, int64_t N, int64_t K, int64_t t0, int64_t t1, const uint8_t* wp,
               const S* sp, const S* mp, const int8_t* xq, const float* xd,
               const float* sx, const int32_t* xs, float* yp) {
  const int64_t B = K / 32, tile_bytes = B * (Q4 ? 256 : 512);
  float out[4 * 16];
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = wp + t * tile_bytes;
    const S* st = sp + t * B * 16;
    const S* mt = Q4 ? mp + t * B * 16 : nullptr;
    const int64_t n0 = t * 16, valid = std::min<int64_t>(16, N - n0);
    for (int64_t r0 = 0; r0 < M;) {
      const int64_t mr = std::min<int64_t>(4, M - r0);
      const int8_t* x = xq + r0 * K;
      const float *d = xd + r0 * B, *s = sx + r0 * B;
      const int32_t* c = xs + r0 * B;
      switch (mr) {
        case 4: tile<4, Q4, S>(B, K, wt, st, mt, x, d, s, c, out); break;
        case 3: tile<3, Q4, S>(B, K, wt, st, mt, x, d, s, c, out); break;
        case 2: tile<2, Q4, S>(B, K, wt, st, mt, x, d, s, c, out); break;
        default: tile<1, Q4, S>(B, K, wt, st, mt, x, d, s, c, out); break;
      }
      for (int64_t r = 0; r < mr; ++r)
        std::memcpy(yp + (r0 + r) * N + n0, out + r * 16, valid * sizeof(float));
      r0 += mr;
    }
  }
}
#else
constexpr bool kTiled = false;
#endif

at::Tensor qgemv_q8t(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s,
                     const c10::optional<at::Tensor>& m, int64_t n_out) {
  TORCH_CHECK(kTiled, "qgemv_q8t needs a build with AVX-512 VNNI (this one has none)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  x.size(1) % 32 == 0,
              "x must be a contiguous float32 [M, K] tensor with K a multiple of 32, got ",
              x.sizes(), " ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), B = K / 32, T = (n_out + 15) / 16;
  const bool q4 = m.has_value();
  const int64_t kb = q4 ? 256 : 512;
  TORCH_CHECK(n_out > 0 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.numel() == T * B * kb,
              "tiled levels must be contiguous uint8 with ", T * B * kb, " bytes for N = ",
              n_out, ", K = ", K, ", got ", w.sizes(), " ", w.scalar_type());
  const bool half = s.scalar_type() == at::kHalf;
  TORCH_CHECK((half || s.scalar_type() == at::kFloat) && s.is_contiguous() &&
                  s.numel() == T * B * 16,
              "tiled scales must be contiguous float32 or float16 [T, B, 16] = [", T, ", ", B,
              ", 16], got ", s.sizes(), " ", s.scalar_type());
  if (q4)
    TORCH_CHECK(m->scalar_type() == s.scalar_type() && m->is_contiguous() &&
                    m->sizes() == s.sizes(),
                "tiled mins must be contiguous and of the scales' dtype and shape");
  at::Tensor y = at::empty({M, n_out}, x.options());
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xf;
  thread_local std::vector<int32_t> xs;
  const int64_t nb = M * B;
  xq.resize(M * K);
  xf.resize(2 * nb);
  xs.resize(nb);
  const float* xp = x.data_ptr<float>();
  int8_t* q = xq.data();
  float *d = xf.data(), *sx = xf.data() + nb;
  int32_t* c = xs.data();
  auto quantize = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      attnlab_q8::quantize_block(xp + i * 32, q + i * 32, d + i, sx + i, c + i);
      c[i] *= -128;  // the Q8 accumulator's start: -128 * sum of the block's levels
    }
  };
  if (nb >= 256)
    at::parallel_for(0, nb, 64, quantize);
  else
    quantize(0, nb);
  const auto* wp = w.data_ptr<uint8_t>();
  const void* sp = s.data_ptr();
  const void* mp = q4 ? m->data_ptr() : nullptr;
  float* yp = y.data_ptr<float>();
  // about 64 KiB of weights per task, times the rows: small layers stay on one thread
  const int64_t work = B * kb * std::max<int64_t>(1, std::min<int64_t>(M, 16));
  const int64_t grain = std::max<int64_t>(1, 65536 / work);
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    auto run = [&](auto* sp_, auto* mp_) {
      if (q4)
        run_tiles<true>(M, n_out, K, t0, t1, wp, sp_, mp_, q, d, sx, c, yp);
      else
        run_tiles<false>(M, n_out, K, t0, t1, wp, sp_, mp_, q, d, sx, c, yp);
    };
    if (half)
      run(static_cast<const uint16_t*>(sp), static_cast<const uint16_t*>(mp));
    else
      run(static_cast<const float*>(sp), static_cast<const float*>(mp));
  });
#endif
  return y;
}

bool q8t_available() { return kTiled; }

}  // namespace

TORCH_LIBRARY(attnlab_qt, m) {
  m.def("qgemv_q8t(Tensor x, Tensor w, Tensor s, Tensor? m, int n_out) -> Tensor");
  m.def("available() -> bool", &q8t_available);
}

TORCH_LIBRARY_IMPL(attnlab_qt, CPU, m) { m.impl("qgemv_q8t", &qgemv_q8t); }
