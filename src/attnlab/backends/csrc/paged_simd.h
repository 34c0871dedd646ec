// The SIMD types of paged_attention.cpp: scalar floats, AVX2+FMA and AVX-512 behind one
// interface (load, masked load, fma, max, a horizontal sum, a polynomial exp, ...), so
// the kernel is written once and built for whichever -march allows. Included inside
// paged_attention.cpp's anonymous namespace.
#pragma once

constexpr float kInf = std::numeric_limits<float>::infinity();

// exp(x) = 2^n * e^r, n = round(x / ln 2), |r| <= ln2 / 2; e^r = 1 + r + r^2 P(r) with
// Cephes' degree-5 minimax P (expf.c); ln 2 split in two so r is exact to float rounding.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpHi = 88.3762626647949f, kExpLo = -87.3365447504f;  // 2^-126 below
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

struct Scalar {
  static constexpr int W = 1;
  using T = float;
  static T load(const float* p) { return *p; }
  static T loadn(const float* p, int64_t) { return *p; }
  static void store(float* p, T v) { *p = v; }
  static T set1(float x) { return x; }
  static T zero() { return 0.f; }
  static T fma(T a, T b, T c) { return a * b + c; }
  static T add(T a, T b) { return a + b; }
  static T sub(T a, T b) { return a - b; }
  static T mul(T a, T b) { return a * b; }
  static T max(T a, T b) { return a > b ? a : b; }
  static float hsum(T v) { return v; }
  static T base(T m) { return m == -kInf ? 0.f : m; }  // a row that saw no key: 0
  static T outside(T s, T i, T lo, T hi) { return i < lo || i > hi ? -kInf : s; }
  static T min(T a, T b) { return a < b ? a : b; }
  static T fnma(T a, T b, T c) { return c - a * b; }
  static T round(T x) { return std::nearbyint(x); }
  static T pow2(T n) {  // 2^n for an integral n in [-126, 127]; NaN stays NaN
    if (n != n) return n;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
  }
  static T zero_below(T y, T x, float lo) { return x < lo ? 0.f : y; }
  static T exp(T x);
};

#if defined(__AVX2__) && defined(__FMA__)
struct Avx2 {
  static constexpr int W = 8;
  using T = __m256;
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T loadn(const float* p, int64_t n) {  // the first n lanes; the rest 0, never read
    if (n >= W) return _mm256_loadu_ps(p);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lanes));
  }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T zero() { return _mm256_setzero_ps(); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static float hsum(T v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static T base(T m) {
    return _mm256_blendv_ps(m, zero(), _mm256_cmp_ps(m, set1(-kInf), _CMP_EQ_OQ));
  }
  static T outside(T s, T i, T lo, T hi) {  // -inf where key i is outside lo .. hi
    const T out = _mm256_or_ps(_mm256_cmp_ps(i, lo, _CMP_LT_OQ), _mm256_cmp_ps(i, hi, _CMP_GT_OQ));
    return _mm256_blendv_ps(s, set1(-kInf), out);
  }
  static T min(T a, T b) { return _mm256_min_ps(a, b); }
  static T fnma(T a, T b, T c) { return _mm256_fnmadd_ps(a, b, c); }
  static T round(T x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static T pow2(T n) {  // 2^n for integral lanes in [-126, 127]
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  static T zero_below(T y, T x, float lo) {
    return _mm256_blendv_ps(y, zero(), _mm256_cmp_ps(x, set1(lo), _CMP_LT_OQ));
  }
  static T exp(T x);
};
#endif

#if defined(__AVX512F__)
struct Avx512 {
  static constexpr int W = 16;
  using T = __m512;
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T loadn(const float* p, int64_t n) {  // masked lanes are never read
    return n >= W ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), p);
  }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T zero() { return _mm512_setzero_ps(); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static float hsum(T v) { return _mm512_reduce_add_ps(v); }
  static T base(T m) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, set1(-kInf), _CMP_EQ_OQ), m, zero());
  }
  static T outside(T s, T i, T lo, T hi) {  // -inf where key i is outside lo .. hi
    const __mmask16 out = _mm512_cmp_ps_mask(i, lo, _CMP_LT_OQ) | _mm512_cmp_ps_mask(i, hi, _CMP_GT_OQ);
    return _mm512_mask_blend_ps(out, s, set1(-kInf));
  }
  static T min(T a, T b) { return _mm512_min_ps(a, b); }
  static T fnma(T a, T b, T c) { return _mm512_fnmadd_ps(a, b, c); }
  static T round(T x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static T pow2(T n) {  // 2^n for integral lanes in [-126, 127]
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
  static T zero_below(T y, T x, float lo) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, set1(lo), _CMP_LT_OQ), y, zero());
  }
  static T exp(T x);
};
#endif

// The SIMD widths this build holds, widest first (what the kernels' simd_widths() report).
inline std::vector<int64_t> widths() {
  return {
#if defined(__AVX512F__)
      16,
#endif
#if defined(__AVX2__) && defined(__FMA__)
      8,
#endif
      1};
}

// exp(x) for every width, from the primitives above: clamp (NaN passes through both
// bounds), split x = n ln2 + r, evaluate the polynomial, scale by 2^n; below kExpLo the
// result is 0 (it would be subnormal).
template <class V>
inline typename V::T poly_exp(typename V::T x0) {
  using T = typename V::T;
  const T x = V::max(V::set1(kExpLo), V::min(V::set1(kExpHi), x0));
  const T n = V::round(V::mul(x, V::set1(kLog2e)));
  const T r = V::fnma(n, V::set1(kLn2Lo), V::fnma(n, V::set1(kLn2Hi), x));
  T y = V::set1(kP0);
  for (float c : {kP1, kP2, kP3, kP4, kP5}) y = V::fma(y, r, V::set1(c));
  y = V::fma(y, V::mul(r, r), V::add(r, V::set1(1.f)));
  return V::zero_below(V::mul(y, V::pow2(n)), x0, kExpLo);
}

inline Scalar::T Scalar::exp(T x) { return poly_exp<Scalar>(x); }
#if defined(__AVX2__) && defined(__FMA__)
inline Avx2::T Avx2::exp(T x) { return poly_exp<Avx2>(x); }
#endif
#if defined(__AVX512F__)
inline Avx512::T Avx512::exp(T x) { return poly_exp<Avx512>(x); }
#endif
