// llama.cpp's Q8_0/Q8_1 activation blocks (shared by qgemv.cpp and qgemv_tiled.cpp).
#pragma once

#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace attnlab_q8 {

// One block of 32: llama.cpp's quantize_row_q8_1 (x86): d = amax / 127 as float16,
// multiplier 127 / amax in float32, round half to even; sx = fp16(d * sum q).
inline void quantize_block(const float* x, int8_t* q, float* d16, float* sx, int32_t* qsum = nullptr) {
#if defined(__AVX2__)
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float am = _mm_cvtss_f32(m4);
  const __m256 mul = _mm256_set1_ps(am != 0.f ? 127.f / am : 0.f);
  __m256i iv[4];
  __m256i sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    iv[i] = _mm256_cvtps_epi32(
        _mm256_round_ps(_mm256_mul_ps(v[i], mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    sum = _mm256_add_epi32(sum, iv[i]);
  }
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]),
                                       _mm256_packs_epi32(iv[2], iv[3]));
  // the packs work per 128-bit lane: put the 4-byte groups back in order
  const __m256i ordered = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
  const int32_t total = _mm_cvtsi128_si32(s4);
#else
  float am = 0.f;
  for (int j = 0; j < 32; ++j) am = std::max(am, std::fabs(x[j]));
  const float id = am != 0.f ? 127.f / am : 0.f;
  int32_t total = 0;
  for (int j = 0; j < 32; ++j) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(x[j] * id));
    q[j] = static_cast<int8_t>(v);
    total += v;
  }
#endif
  const float d = am / 127.f;
  if (qsum != nullptr) *qsum = total;
  *d16 = static_cast<float>(c10::Half(d));
  *sx = static_cast<float>(c10::Half(d * static_cast<float>(total)));
}

}  // namespace attnlab_q8
