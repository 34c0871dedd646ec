// Quantized-weight GEMV kernels for a few rows of activations (decoding), CPU.
//
// Weights: levels in blocks of 32 along K with one float scale per group of gs input
// features (gs a multiple of 32) and, for 4-bit levels, one minimum: w = s * q (+ m).
// 4-bit levels are stored two a byte in GGUF's in-block order: byte j of a block holds
// element j in its low nibble and element j + 16 in its high one.
//
// Two ops (namespace attnlab_q):
//   qgemv     float32 activations: each block of levels expanded in registers and
//             multiplied in float32 (the "fused" kernel).
//   qgemv_q8  int8 activations, as llama.cpp multiplies quantized weights on the CPU
//             (ggml/src/ggml-cpu/arch/x86/quants.c: quantize_row_q8_0 / _q8_1 and
//             ggml_vec_dot_q8_0_q8_0 / _q4_1_q8_1): each row of x is quantized once per
//             call into blocks of 32, d = amax / 127 kept in float16, q = round-to-nearest-
//             even(x * (127 / amax)) in [-127, 127]; and for 4-bit weights the block's
//             sx = fp16(d * sum q) (Q8_1's s). Then per block an exact int32 dot product
//             (AVX-512 VNNI vpdpbusd where compiled for it, else AVX2 vpmaddubsw +
//             vpmaddwd, else scalar) and
//               y[r, n] = sum_b sw[n, g(b)] * d[r, b] * dot_b (+ mw[n, g(b)] * sx[r, b]).
//   quantize_q8  the activation blocks alone (for references and tests).
//
// Shapes: x [M, K] float32 contiguous; q [N, K] int8 or [N, K/2] uint8; s, m [N, K/gs]
// float32; y [M, N] float32. Parallel over N with at::parallel_for (torch's threads).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "q8_blocks.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

namespace {

// ------------------------------------------------------------------ float32 activations

typedef float f16v __attribute__((vector_size(64)));
typedef uint8_t u8v __attribute__((vector_size(16)));
typedef int8_t i8v __attribute__((vector_size(16)));
typedef int32_t i32v __attribute__((vector_size(64)));
#define TO_F(v) __builtin_convertvector(__builtin_convertvector((v), i32v), f16v)
// signed bytes through the unsigned widening: q = (q ^ 0x80 as unsigned) - 128
#define TO_F_SIGNED(v) \
  __builtin_convertvector(__builtin_convertvector((u8v)(v) ^ 0x80, i32v) - 128, f16v)

inline f16v load_f(const float* p) {
  f16v v;
  std::memcpy(&v, p, 64);
  return v;
}
inline float hsum(f16v v) {
  float t = 0.f;
  for (int j = 0; j < 16; ++j) t += v[j];
  return t;
}

float f_q8_row(const float* __restrict xr, const int8_t* __restrict qn,
               const float* __restrict sn, int64_t S, int64_t per) {
  f16v acc = {0};
  for (int64_t g = 0; g < S; ++g) {
    f16v t = {0};
    for (int64_t b = g * per; b < (g + 1) * per; ++b) {
      __builtin_prefetch(qn + b * 32 + 4096);  // see prefetch() below
      i8v lo, hi;
      std::memcpy(&lo, qn + b * 32, 16);
      std::memcpy(&hi, qn + b * 32 + 16, 16);
      t += load_f(xr + b * 32) * TO_F_SIGNED(lo) + load_f(xr + b * 32 + 16) * TO_F_SIGNED(hi);
    }
    acc += sn[g] * t;
  }
  return hsum(acc);
}

float f_q4_row(const float* __restrict xr, const uint8_t* __restrict qn,
               const float* __restrict sn, int64_t S, int64_t per) {
  f16v acc = {0};
  for (int64_t g = 0; g < S; ++g) {
    f16v t = {0};
    for (int64_t b = g * per; b < (g + 1) * per; ++b) {
      if (b % 2 == 0) __builtin_prefetch(qn + b * 16 + 4096);
      u8v v;
      std::memcpy(&v, qn + b * 16, 16);
      t += load_f(xr + b * 32) * TO_F(v & 15) + load_f(xr + b * 32 + 16) * TO_F(v >> 4);
    }
    acc += sn[g] * t;
  }
  return hsum(acc);
}

struct Dims {
  int64_t M, N, K, gs, S, per;
};

Dims check(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s,
           const c10::optional<at::Tensor>& m, int64_t gs) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor, got ", x.sizes(), " ",
              x.scalar_type());
  TORCH_CHECK(gs > 0 && gs % 32 == 0 && x.size(1) % gs == 0, "group_size ", gs,
              " must be a multiple of 32 dividing K = ", x.size(1));
  Dims d{x.size(0), s.size(0), x.size(1), gs, x.size(1) / gs, gs / 32};
  TORCH_CHECK(s.dim() == 2 && s.scalar_type() == at::kFloat && s.is_contiguous() &&
                  s.size(1) == d.S,
              "scales must be contiguous float32 [N, K/G] = [", d.N, ", ", d.S, "], got ",
              s.sizes());
  TORCH_CHECK(q.is_contiguous() && q.dim() == 2 && q.size(0) == d.N, "levels must be [N, ...]");
  if (m.has_value()) {
    TORCH_CHECK(q.scalar_type() == at::kByte && q.size(1) * 2 == d.K,
                "4-bit levels must be uint8 [N, K/2], got ", q.sizes(), " ", q.scalar_type());
    TORCH_CHECK(m->scalar_type() == at::kFloat && m->is_contiguous() && m->sizes() == s.sizes(),
                "mins must be contiguous float32 like the scales");
  } else {
    TORCH_CHECK(q.scalar_type() == at::kChar && q.size(1) == d.K,
                "int8 levels must be int8 [N, K], got ", q.sizes(), " ", q.scalar_type());
  }
  return d;
}

int64_t grain(const Dims& d) {
  // about 32 KiB of weights per task: small layers stay on one thread
  const int64_t row_bytes = std::max<int64_t>(d.K, 1);
  return std::max<int64_t>(1, 32768 / row_bytes);
}

at::Tensor qgemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s,
                 const c10::optional<at::Tensor>& m, int64_t group_size) {
  const Dims d = check(x, q, s, m, group_size);
  at::Tensor y = at::empty({d.M, d.N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (!m.has_value()) {
    const int8_t* qp = q.data_ptr<int8_t>();
    at::parallel_for(0, d.N, grain(d), [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t r = 0; r < d.M; ++r)
          yp[r * d.N + n] = f_q8_row(xp + r * d.K, qp + n * d.K, sp + n * d.S, d.S, d.per);
    });
    return y;
  }
  // x's sums per group, for the minimums' term: [M, S]
  std::vector<float> xs(d.M * d.S, 0.f);
  for (int64_t r = 0; r < d.M; ++r)
    for (int64_t g = 0; g < d.S; ++g) {
      float t = 0.f;
      for (int64_t k = 0; k < d.gs; ++k) t += xp[r * d.K + g * d.gs + k];
      xs[r * d.S + g] = t;
    }
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* mp = m->data_ptr<float>();
  at::parallel_for(0, d.N, grain(d), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t r = 0; r < d.M; ++r) {
        float t = f_q4_row(xp + r * d.K, qp + n * (d.K / 2), sp + n * d.S, d.S, d.per);
        for (int64_t g = 0; g < d.S; ++g) t += mp[n * d.S + g] * xs[r * d.S + g];
        yp[r * d.N + n] = t;
      }
  });
  return y;
}

// ------------------------------------------------------------------ int8 activations

using attnlab_q8::quantize_block;

#if defined(__AVX2__)
inline __m256i dot_u8s8(__m256i u, __m256i s8) {  // 8 int32 partial sums of u * s8
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s8);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s8), _mm256_set1_epi16(1));
#endif
}
inline float hsum8(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
#endif

inline int32_t dot_scalar_s8(const int8_t* w, const int8_t* a) {
  int32_t t = 0;
  for (int j = 0; j < 32; ++j) t += static_cast<int32_t>(w[j]) * a[j];
  return t;
}
inline int32_t dot_scalar_u4(const uint8_t* w, const int8_t* a) {
  int32_t t = 0;
  for (int j = 0; j < 16; ++j) t += (w[j] & 15) * a[j] + (w[j] >> 4) * a[j + 16];
  return t;
}

struct Act {  // the quantized activations: [M, K] levels, [M, K/32] scales and sums
  const int8_t* q;
  const float* d;
  const float* sx;
};

#if defined(__AVX2__)
// One block of 32 levels as 32 unsigned bytes u, and the activations' bytes signed to
// match (u * s8 summed is the block's dot product). int8 weights: u = |w|, s8 = x * sign(w)
// (exact for w = -128 too; x lies in [-127, 127]); 4-bit weights: u = the levels, s8 = x.
struct Q8W {
  static constexpr int64_t kBytes = 32;
  static __m256i levels(const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static __m256i u(__m256i w) { return _mm256_sign_epi8(w, w); }
  static __m256i s8(__m256i x, __m256i w) { return _mm256_sign_epi8(x, w); }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  static __m512i levels2(const uint8_t* p) { return _mm512_loadu_si512(p); }  // 2 blocks
  static __m512i u2(__m512i w) { return _mm512_abs_epi8(w); }
  static __m512i s82(__m512i x, __m512i w) {
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  }
#endif
};
struct Q4W {
  static constexpr int64_t kBytes = 16;
  static __m256i levels(const uint8_t* p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i both =
        _mm256_insertf128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
  }
  static __m256i u(__m256i w) { return w; }
  static __m256i s8(__m256i x, __m256i) { return x; }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  static __m512i levels2(const uint8_t* p) {  // [b lo | b+1 lo | b hi | b+1 hi] -> in order
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i m = _mm256_set1_epi8(0x0F);
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, m)),
                                         _mm256_and_si256(_mm256_srli_epi16(v, 4), m), 1);
    return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
  }
  static __m512i u2(__m512i w) { return w; }
  static __m512i s82(__m512i x, __m512i) { return x; }
#endif
};

// The weights stream from memory once per token: ask for the bytes 4 KiB ahead (the next
// rows of this task), which measured 1.5x over the hardware prefetcher alone on a
// loaded machine (a 30-layer SmolLM2-shaped set of matrices, one thread).
inline void prefetch(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p) + 4096, _MM_HINT_T0);
}

// One activation row against one output feature: sum_b sw[b] * xd[b] * dot_b (the
// scales per block: one weight scale per block of 32, or the products precomputed in sw
// with xd = null).
template <class W>
float row_dot(int64_t B, const int8_t* xq, const uint8_t* qn, const float* sw, const float* xd) {
  int64_t b = 0;
  auto scale = [&](int64_t k) { return xd == nullptr ? sw[k] : sw[k] * xd[k]; };
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // two blocks per 512-bit register, four blocks per step in two accumulators
  const __m512i lo8 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 z0 = _mm512_setzero_ps(), z1 = _mm512_setzero_ps();
  auto pair = [&](int64_t k, __m512 acc) {
    prefetch(qn + k * W::kBytes);
    const __m512i w = W::levels2(qn + k * W::kBytes);
    const __m512i x = _mm512_loadu_si512(xq + k * 32);
    const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), W::u2(w), W::s82(x, w));
    __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(sw + k)));
    if (xd != nullptr)
      two = _mm_mul_ps(two, _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(xd + k))));
    const __m512 cc = _mm512_permutexvar_ps(lo8, _mm512_castps128_ps512(two));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), cc, acc);
  };
  for (; b + 4 <= B; b += 4) {
    z0 = pair(b, z0);
    z1 = pair(b + 2, z1);
  }
  if (b + 2 <= B) z0 = pair(b, z0), b += 2;
  z0 = _mm512_add_ps(z0, z1);
  __m256 acc = _mm256_add_ps(_mm512_castps512_ps256(z0), _mm512_extractf32x8_ps(z0, 1));
#else
  __m256 acc = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; b + 2 <= B; b += 2) {
    prefetch(qn + b * W::kBytes);
    const __m256i w0 = W::levels(qn + b * W::kBytes), w1 = W::levels(qn + (b + 1) * W::kBytes);
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32 + 32));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(W::u(w0), W::s8(x0, w0))),
                          _mm256_set1_ps(scale(b)), acc);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(W::u(w1), W::s8(x1, w1))),
                           _mm256_set1_ps(scale(b + 1)), acc1);
  }
  acc = _mm256_add_ps(acc, acc1);
#endif
  for (; b < B; ++b) {
    const __m256i w0 = W::levels(qn + b * W::kBytes);
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(W::u(w0), W::s8(x0, w0))),
                          _mm256_set1_ps(scale(b)), acc);
  }
  return hsum8(acc);
}

// sum_b a[b] * c[b] over B floats in vector lanes (the minimums' term of 4-bit weights)
inline float dot_f(const float* a, const float* c, int64_t B) {
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= B; b += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + b), _mm256_loadu_ps(c + b), acc);
  float t = hsum8(acc);
  for (; b < B; ++b) t += a[b] * c[b];
  return t;
}

// R rows of activations against one output feature (levels qn, scales sn, mins mn or
// null); c is scratch of 2 * B floats (groups wider than a block: per-block scales).
template <int R, class W>
void rows_simd(const Dims& dm, const Act& a, int64_t r0, const uint8_t* qn, const float* sn,
               const float* mn, float* out, float* c) {
  const int64_t B = dm.K / 32, per = dm.per;
  const float* swb = sn;  // the weight scale of each block
  const float* mwb = mn;
  if (per > 1) {
    for (int64_t b = 0; b < B; ++b) c[b] = sn[b / per];
    if (mn != nullptr)
      for (int64_t b = 0; b < B; ++b) c[B + b] = mn[b / per];
    swb = c, mwb = mn == nullptr ? nullptr : c + B;
  }
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r;
    const float m = mwb == nullptr ? 0.f : dot_f(mwb, a.sx + row * B, B);
    out[r] = row_dot<W>(B, a.q + row * dm.K, qn, swb, a.d + row * B) + m;
  }
}
#endif

// The same without SIMD (any CPU): exact int32 dots, float32 sums.
template <int R>
void rows_scalar(const Dims& dm, const Act& a, int64_t r0, const uint8_t* qn, const float* sn,
                 const float* mn, float* out) {
  const int64_t B = dm.K / 32;
  for (int r = 0; r < R; ++r) {
    const int8_t* xq = a.q + (r0 + r) * dm.K;
    float t = 0.f;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t g = b / dm.per;
      if (mn == nullptr) {
        const auto* w = reinterpret_cast<const int8_t*>(qn + b * 32);
        t += sn[g] * a.d[(r0 + r) * B + b] * static_cast<float>(dot_scalar_s8(w, xq + b * 32));
      } else {
        t += sn[g] * a.d[(r0 + r) * B + b] *
                 static_cast<float>(dot_scalar_u4(qn + b * 16, xq + b * 32)) +
             mn[g] * a.sx[(r0 + r) * B + b];
      }
    }
    out[r] = t;
  }
}

template <int R>
void rows(const Dims& dm, const Act& a, int64_t r0, const uint8_t* qn, const float* sn,
          const float* mn, float* out, float* c) {
#if defined(__AVX2__)
  if (mn == nullptr)
    rows_simd<R, Q8W>(dm, a, r0, qn, sn, mn, out, c);
  else
    rows_simd<R, Q4W>(dm, a, r0, qn, sn, mn, out, c);
#else
  rows_scalar<R>(dm, a, r0, qn, sn, mn, out);
#endif
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_q8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  x.size(1) % 32 == 0,
              "x must be a contiguous float32 [M, K] tensor with K a multiple of 32, got ",
              x.sizes(), " ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), B = K / 32;
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, B}, x.options());
  at::Tensor sx = at::empty({M, B}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  float* sp = sx.data_ptr<float>();
  for (int64_t i = 0; i < M * B; ++i) quantize_block(xp + i * 32, qp + i * 32, dp + i, sp + i);
  return {q, d, sx};
}

template <int R>
void q8_task(const Dims& d, const Act& a, int64_t r0, const uint8_t* qp, const float* sp,
             const float* mp, float* yp, int64_t n0, int64_t n1) {
  const int64_t row_bytes = mp == nullptr ? d.K : d.K / 2;
  float out[R];
  std::vector<float> c(d.per > 1 ? 2 * (d.K / 32) : 0);  // per-block scales of wider groups
  for (int64_t n = n0; n < n1; ++n) {
    rows<R>(d, a, r0, qp + n * row_bytes, sp + n * d.S, mp == nullptr ? nullptr : mp + n * d.S,
            out, c.data());
    for (int r = 0; r < R; ++r) yp[(r0 + r) * d.N + n] = out[r];
  }
}

at::Tensor qgemv_q8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s,
                    const c10::optional<at::Tensor>& m, int64_t group_size) {
  const Dims d = check(x, q, s, m, group_size);
  // the activation blocks, in buffers kept per thread between calls
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd;
  const int64_t nb = d.M * (d.K / 32);
  xq.resize(d.M * d.K);
  xd.resize(2 * nb);
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < nb; ++i)
    quantize_block(xp + i * 32, xq.data() + i * 32, xd.data() + i, xd.data() + nb + i);
  const Act a{xq.data(), xd.data(), xd.data() + nb};
  at::Tensor y = at::empty({d.M, d.N}, x.options());
  const float* sp = s.data_ptr<float>();
  const float* mp = m.has_value() ? m->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const auto* qp = static_cast<const uint8_t*>(q.data_ptr());
  at::parallel_for(0, d.N, grain(d), [&](int64_t n0, int64_t n1) {
    int64_t r0 = 0;  // rows in fours (the weights' block read once for four rows), then ones
    for (; r0 + 4 <= d.M; r0 += 4) q8_task<4>(d, a, r0, qp, sp, mp, yp, n0, n1);
    for (; r0 < d.M; ++r0) q8_task<1>(d, a, r0, qp, sp, mp, yp, n0, n1);
  });
  return y;
}

const char* simd() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512_vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

std::string int8_dot() { return simd(); }

}  // namespace

TORCH_LIBRARY(attnlab_q, m) {
  m.def("qgemv(Tensor x, Tensor q, Tensor s, Tensor? m, int group_size) -> Tensor");
  m.def("qgemv_q8(Tensor x, Tensor q, Tensor s, Tensor? m, int group_size) -> Tensor");
  m.def("quantize_q8(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("int8_dot() -> str", &int8_dot);
}

// CPU kernels (the fake/meta shapes are registered from Python, for tracing only)
TORCH_LIBRARY_IMPL(attnlab_q, CPU, m) {
  m.impl("qgemv", &qgemv);
  m.impl("qgemv_q8", &qgemv_q8);
  m.impl("quantize_q8", &quantize_q8);
}
