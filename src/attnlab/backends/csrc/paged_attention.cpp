// Paged attention on the CPU that reads a paged KV pool in place (no gathered copy).
//
// PagedAttention (Kwon et al., 2023, section 4.1): each sequence's keys/values sit in
// fixed-size blocks of one pool per layer, listed in order by its block table. This
// kernel walks a row's keys through its table in tiles of kKeyTile keys and keeps
// FlashAttention's online softmax (Dao et al., 2022; Milakov & Gimelshein, 2018) per
// query and head, so no key is copied out of the pool and no score matrix is built.
//
// Shapes: B rows, H query heads, G key/value heads (H = G * rep), L query positions,
// E key head dim, Ev value head dim, S pool slots (blocks * bs), nb table columns.
//   q      [B, H, L, E] float32 (any strides)
//   k_pool [S, G, E], v_pool [S, G, Ev] float32, contiguous
//   table  [B, nb] int64, contiguous: the row's blocks in order
//   q_pos  [B, L] int64 (any strides, stride 0 to broadcast): each query's slot
//   meta   [B, 3] int64, contiguous: (length, offset, first_block) of each row; key j
//          (first_block * bs <= j < length) of row b sits at slot offset + j
//   out    [B, H, L, Ev] float32, contiguous (written)
// A query at slot t sees the keys at slots s <= t, and s >= t - window when window >= 0
// (the causal and sliding-window patterns). A query that sees no key gets zeros.
//
// One task is (row, tile of up to 16 queries). Its M = nq * rep query rows of each key
// head g share every key: a tile's scores are a small GEMM S^T [keys, M] (the queries
// transposed once per task, each key element broadcast from the pool in place), or for
// a few rows (decode: M = rep) one dot product per (key, row). The softmax runs across
// the M rows in SIMD lanes, with one rescale of the accumulators per key tile, and the
// values are added as P^T [M, keys] x V [keys, Ev], register-blocked 4 rows x 4 vectors.
//
// SIMD: the same code is instantiated for AVX-512, AVX2+FMA and plain scalar floats,
// whichever the build's -march allows; the widest runs, `paged_attention_simd` picks one
// (tests compare them). exp is a polynomial (vexp below): max relative error about
// 2 ulp (measured < 2.4e-7 against float64 on [-87, 88], tests/backends/
// test_paged_kernel_simd.py); below -87.34 it returns 0 (true value < 2^-126).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kQueryTile = 16;
constexpr int64_t kKeyTile = 32;
constexpr int64_t kDotRows = 8;  // at most this many rows per key head: dot products
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
  static T mul(T a, T b) { return a * b; }
  static T max(T a, T b) { return a > b ? a : b; }
  static float hsum(T v) { return v; }
  static T base(T m) { return m == -kInf ? 0.f : m; }  // a row that saw no key: 0
  static T exp(T x) {
    if (x != x) return x;
    if (x < kExpLo) return 0.f;
    x = std::min(x, kExpHi);
    const float fx = std::nearbyint(x * kLog2e);
    const float r = (x - fx * kLn2Hi) - fx * kLn2Lo;
    float y = kP0;
    for (float c : {kP1, kP2, kP3, kP4, kP5}) y = y * r + c;
    y = y * (r * r) + r + 1.f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(fx) + 127) << 23;
    float pow2;
    std::memcpy(&pow2, &bits, 4);
    return y * pow2;
  }
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
  static T exp(T x) {
    const T under = _mm256_cmp_ps(x, set1(kExpLo), _CMP_LT_OQ);
    x = _mm256_max_ps(set1(kExpLo), _mm256_min_ps(set1(kExpHi), x));  // NaN stays NaN
    const T fx = _mm256_round_ps(mul(x, set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const T r = _mm256_fnmadd_ps(fx, set1(kLn2Lo), _mm256_fnmadd_ps(fx, set1(kLn2Hi), x));
    T y = set1(kP0);
    for (float c : {kP1, kP2, kP3, kP4, kP5}) y = fma(y, r, set1(c));
    y = fma(y, mul(r, r), add(r, set1(1.f)));
    const __m256i n = _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127));
    y = mul(y, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23)));
    return _mm256_blendv_ps(y, zero(), under);
  }
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
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static float hsum(T v) { return _mm512_reduce_add_ps(v); }
  static T base(T m) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, set1(-kInf), _CMP_EQ_OQ), m, zero());
  }
  static T exp(T x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, set1(kExpLo), _CMP_LT_OQ);
    x = _mm512_max_ps(set1(kExpLo), _mm512_min_ps(set1(kExpHi), x));  // NaN stays NaN
    const T fx = _mm512_roundscale_ps(mul(x, set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const T r = _mm512_fnmadd_ps(fx, set1(kLn2Lo), _mm512_fnmadd_ps(fx, set1(kLn2Hi), x));
    T y = set1(kP0);
    for (float c : {kP1, kP2, kP3, kP4, kP5}) y = fma(y, r, set1(c));
    y = fma(y, mul(r, r), add(r, set1(1.f)));
    const __m512i n = _mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127));
    y = mul(y, _mm512_castsi512_ps(_mm512_slli_epi32(n, 23)));
    return _mm512_mask_blend_ps(under, y, zero());
  }
};
#endif

struct Args {
  const float* q;
  const float* k;
  const float* v;
  const int64_t* table;
  const int64_t* q_pos;
  const int64_t* meta;
  float* out;
  int64_t H, G, L, E, Ev, nb, bs, window;
  int64_t qs0, qs1, qs2, qs3;  // strides of q
  int64_t ps0, ps1;            // strides of q_pos
  float scale;
};

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// The keys query w of row b sees: indices lo .. hi of the row (hi < lo: none).
inline void key_range(const Args& a, int64_t b, int64_t w, int64_t& lo, int64_t& hi) {
  const int64_t length = a.meta[b * 3], offset = a.meta[b * 3 + 1];
  const int64_t t = a.q_pos[b * a.ps0 + w * a.ps1];
  hi = std::min(length - 1, t - offset);
  lo = a.meta[b * 3 + 2] * a.bs;
  if (a.window >= 0) lo = std::max(lo, t - a.window - offset);
}

// A task's buffers, per thread. Rows m = (w - w0) * rep + (h % rep) of key head g; Mp
// rows padded to whole vectors (and to 4, the value kernel's row block).
struct Work {
  std::vector<float> q, s, m, l, corr, acc;
  std::vector<int64_t> lo, hi;
  std::vector<const float*> kp, vp;
  Work(const Args& a, int64_t mp, int64_t evp)
      : q(a.G * round_up(a.E, 16) * mp), s((kKeyTile + 4) * mp), m(a.G * mp), l(a.G * mp),
        corr(mp), acc(a.G * mp * evp), lo(kQueryTile), hi(kQueryTile), kp(kKeyTile + 4),
        vp(kKeyTile + 4) {}
};

template <class V>
struct Kernel {
  static constexpr int W = V::W;
  static constexpr int64_t NB = W == 16 ? 4 : 2;  // vectors per register block (32 or 16 regs)
  using T = typename V::T;

  // S^T[j][m] for keys j0 .. j0+3 (pointers kp[j]) and row vectors c .. c+NM-1:
  // qt [E, mp] holds the scaled queries transposed; each key element is broadcast.
  template <int NM>
  static void qk_gemm(const float* qt, int64_t mp, int64_t E, const float* const* kp,
                      float* s, int64_t c) {
    T acc[4][NM];
    for (int i = 0; i < 4; ++i)
      for (int u = 0; u < NM; ++u) acc[i][u] = V::zero();
    for (int64_t e = 0; e < E; ++e) {
      T qv[NM];
      for (int u = 0; u < NM; ++u) qv[u] = V::load(qt + e * mp + (c + u) * W);
      for (int i = 0; i < 4; ++i) {
        const T kb = V::set1(kp[i][e]);
        for (int u = 0; u < NM; ++u) acc[i][u] = V::fma(kb, qv[u], acc[i][u]);
      }
    }
    for (int i = 0; i < 4; ++i)
      for (int u = 0; u < NM; ++u) V::store(s + i * mp + (c + u) * W, acc[i][u]);
  }

  // acc[r][:] = acc[r][:] * corr[r] + sum_j P^T[j][r] v_j for rows m0 .. m0+3 and value
  // vectors c .. c+NV-1 (the last may be partial: n lanes of Ev).
  template <int NV>
  static void pv(const float* s, int64_t mp, int64_t m0, const float* corr,
                 const float* const* vp, int64_t n_keys, int64_t Ev, float* acc,
                 int64_t evp, int64_t c) {
    T o[4][NV];
    for (int r = 0; r < 4; ++r) {
      const T cr = V::set1(corr[m0 + r]);
      for (int u = 0; u < NV; ++u) o[r][u] = V::mul(cr, V::load(acc + (m0 + r) * evp + (c + u) * W));
    }
    for (int64_t j = 0; j < n_keys; ++j) {
      T vv[NV];
      for (int u = 0; u < NV; ++u) vv[u] = V::loadn(vp[j] + (c + u) * W, Ev - (c + u) * W);
      for (int r = 0; r < 4; ++r) {
        const T p = V::set1(s[j * mp + m0 + r]);
        for (int u = 0; u < NV; ++u) o[r][u] = V::fma(p, vv[u], o[r][u]);
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int u = 0; u < NV; ++u) V::store(acc + (m0 + r) * evp + (c + u) * W, o[r][u]);
  }

  template <class F>
  static void blocks(int64_t n, F f) {  // f(start, count) over pieces of count <= NB
    for (int64_t c = 0; c < n; c += NB) f(c, std::min<int64_t>(NB, n - c));
  }

  // Keys t0 .. t0+n-1 of row b (every head's keys and values) fetched into the caches
  // while the tile before them is computed: the loads otherwise wait on memory.
  static void prefetch(const Args& a, int64_t b, int64_t t0, int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t idx = t0 + j;
      const int64_t sl = a.table[b * a.nb + idx / a.bs] * a.bs + idx % a.bs;
      const char* kr = reinterpret_cast<const char*>(a.k + sl * a.G * a.E);
      const char* vr = reinterpret_cast<const char*>(a.v + sl * a.G * a.Ev);
      for (int64_t off = 0; off < a.G * a.E * 4; off += 64) __builtin_prefetch(kr + off);
      for (int64_t off = 0; off < a.G * a.Ev * 4; off += 64) __builtin_prefetch(vr + off);
    }
  }

  // Queries w0 .. w1 - 1 of row b, every head, over the row's keys in tiles.
  static void task(const Args& a, int64_t b, int64_t w0, int64_t w1, Work& s) {
    const int64_t rep = a.H / a.G, nq = w1 - w0, M = nq * rep;
    const int64_t mp = round_up(M, std::max(W, 4)), evp = round_up(a.Ev, W);
    const int64_t ep = round_up(a.E, W);
    const bool dot = M <= kDotRows;
    int64_t lo_all = std::numeric_limits<int64_t>::max(), hi_all = -1;
    for (int64_t w = w0; w < w1; ++w) {
      key_range(a, b, w, s.lo[w - w0], s.hi[w - w0]);
      if (s.hi[w - w0] >= s.lo[w - w0]) {
        lo_all = std::min(lo_all, s.lo[w - w0]);
        hi_all = std::max(hi_all, s.hi[w - w0]);
      }
    }
    const int64_t qsize = dot ? mp * ep : a.E * mp;  // per key head
    std::fill(s.q.begin(), s.q.begin() + a.G * qsize, 0.f);
    for (int64_t h = 0; h < a.H; ++h) {  // dot: q[g][m][ep]; GEMM: q[g][e][mp] (transposed)
      const int64_t g = h / rep;
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t m = (w - w0) * rep + h % rep;
        const float* qv = a.q + b * a.qs0 + h * a.qs1 + w * a.qs2;
        float* qd = s.q.data() + g * qsize;
        for (int64_t e = 0; e < a.E; ++e)
          qd[dot ? m * ep + e : e * mp + m] = qv[e * a.qs3] * a.scale;
      }
    }
    std::fill(s.m.begin(), s.m.begin() + a.G * mp, -kInf);
    std::fill(s.l.begin(), s.l.begin() + a.G * mp, 0.f);
    std::fill(s.acc.begin(), s.acc.begin() + a.G * mp * evp, 0.f);
    const int64_t rows_per_key = a.G;
    if (hi_all >= 0) prefetch(a, b, lo_all, std::min(kKeyTile, hi_all - lo_all + 1));
    for (int64_t t0 = lo_all; hi_all >= 0 && t0 <= hi_all; t0 += kKeyTile) {
      const int64_t n = std::min(kKeyTile, hi_all - t0 + 1);
      if (t0 + n <= hi_all) prefetch(a, b, t0 + n, std::min(kKeyTile, hi_all - t0 - n + 1));
      int64_t slot[kKeyTile];
      for (int64_t j = 0; j < n; ++j) {
        const int64_t idx = t0 + j;
        slot[j] = a.table[b * a.nb + idx / a.bs] * a.bs + idx % a.bs;
      }
      for (int64_t g = 0; g < a.G; ++g) {
        for (int64_t j = 0; j < n + 4; ++j) {  // past n: key 0 again (scores unused)
          const int64_t sl = slot[j < n ? j : 0];
          s.kp[j] = a.k + (sl * rows_per_key + g) * a.E;
          s.vp[j] = a.v + (sl * rows_per_key + g) * a.Ev;
        }
        tile(a, s, g, t0, n, rep, nq, mp, ep, evp, dot);
      }
    }
    for (int64_t h = 0; h < a.H; ++h) {
      const int64_t g = h / rep;
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t m = (w - w0) * rep + h % rep;
        const float lm = s.l[g * mp + m];
        const float inv = lm > 0.f ? 1.f / lm : 0.f;  // no key seen: zeros
        const float* ac = s.acc.data() + (g * mp + m) * evp;
        float* o = a.out + ((b * a.H + h) * a.L + w) * a.Ev;
        for (int64_t e = 0; e < a.Ev; ++e) o[e] = ac[e] * inv;
      }
    }
  }

  // One key tile (keys t0 .. t0+n-1, pointers in s.kp/s.vp) for key head g.
  static void tile(const Args& a, Work& s, int64_t g, int64_t t0, int64_t n, int64_t rep,
                   int64_t nq, int64_t mp, int64_t ep, int64_t evp, bool dot) {
    const int64_t M = nq * rep;
    float* sc = s.s.data();  // S^T [n (+4), mp]
    if (dot) {
      const float* q = s.q.data() + g * mp * ep;
      for (int64_t j = 0; j < n; ++j) {
        const float* kr = s.kp[j];
        for (int64_t m = 0; m < M; ++m) {
          T acc = V::zero();
          for (int64_t e = 0; e < ep; e += W) acc = V::fma(V::load(q + m * ep + e), V::loadn(kr + e, a.E - e), acc);
          sc[j * mp + m] = V::hsum(acc);
        }
        for (int64_t m = M; m < mp; ++m) sc[j * mp + m] = 0.f;
      }
    } else {
      const float* qt = s.q.data() + g * a.E * mp;
      for (int64_t j = 0; j < n; j += 4) {
        blocks(mp / W, [&](int64_t c, int64_t nm) {
          switch (nm) {
            case 4: qk_gemm<4>(qt, mp, a.E, s.kp.data() + j, sc + j * mp, c); break;
            case 3: qk_gemm<3>(qt, mp, a.E, s.kp.data() + j, sc + j * mp, c); break;
            case 2: qk_gemm<2>(qt, mp, a.E, s.kp.data() + j, sc + j * mp, c); break;
            default: qk_gemm<1>(qt, mp, a.E, s.kp.data() + j, sc + j * mp, c);
          }
        });
      }
    }
    for (int64_t m = 0; m < M; ++m) {  // the pattern: keys outside a query's range
      const int64_t lo = s.lo[m / rep], hi = s.hi[m / rep];
      if (lo <= t0 && hi >= t0 + n - 1) continue;
      for (int64_t j = 0; j < n; ++j)
        if (t0 + j < lo || t0 + j > hi) sc[j * mp + m] = -kInf;
    }
    float* mr = s.m.data() + g * mp;
    float* lr = s.l.data() + g * mp;
    for (int64_t c = 0; c < mp; c += W) {  // online softmax across rows, once per tile
      const T m_old = V::load(mr + c);
      T mx = m_old;
      for (int64_t j = 0; j < n; ++j) mx = V::max(mx, V::load(sc + j * mp + c));
      const T base = V::base(mx);
      const T corr = V::exp(V::add(m_old, V::mul(base, V::set1(-1.f))));
      T sum = V::zero();
      for (int64_t j = 0; j < n; ++j) {
        const T p = V::exp(V::add(V::load(sc + j * mp + c), V::mul(base, V::set1(-1.f))));
        V::store(sc + j * mp + c, p);
        sum = V::add(sum, p);
      }
      V::store(lr + c, V::fma(V::load(lr + c), corr, sum));
      V::store(mr + c, mx);
      V::store(s.corr.data() + c, corr);
    }
    float* acc = s.acc.data() + g * mp * evp;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      blocks(evp / W, [&](int64_t c, int64_t nv) {
        const float* const* vp = s.vp.data();
        switch (nv) {
          case 4: pv<4>(sc, mp, m0, s.corr.data(), vp, n, a.Ev, acc, evp, c); break;
          case 3: pv<3>(sc, mp, m0, s.corr.data(), vp, n, a.Ev, acc, evp, c); break;
          case 2: pv<2>(sc, mp, m0, s.corr.data(), vp, n, a.Ev, acc, evp, c); break;
          default: pv<1>(sc, mp, m0, s.corr.data(), vp, n, a.Ev, acc, evp, c);
        }
      });
    }
  }

  static void run(const Args& a, int64_t B) {
    const int64_t tiles = (a.L + kQueryTile - 1) / kQueryTile, rep = a.H / a.G;
    const int64_t mp = round_up(std::min(a.L, kQueryTile) * rep, std::max(W, 4));
    at::parallel_for(0, B * tiles, 1, [&](int64_t begin, int64_t end) {
      Work work(a, mp, round_up(a.Ev, W));
      for (int64_t i = begin; i < end; ++i) {
        const int64_t tile = i % tiles, b = i / tiles;
        const int64_t w0 = tile * kQueryTile, w1 = std::min(a.L, w0 + kQueryTile);
        task(a, b, w0, w1, work);
      }
    });
  }

  static at::Tensor exp_of(const at::Tensor& x) {  // vexp over a float32 tensor (tests)
    at::Tensor c = x.contiguous(), y = at::empty_like(c);
    const float* src = c.data_ptr<float>();
    float* dst = y.data_ptr<float>();
    const int64_t n = c.numel();
    int64_t i = 0;
    for (; i + W <= n; i += W) V::store(dst + i, V::exp(V::load(src + i)));
    for (; i < n; ++i) dst[i] = Scalar::exp(src[i]);
    return y;
  }
};

std::vector<int64_t> widths() {  // the SIMD widths this build holds, widest first
  std::vector<int64_t> w;
#if defined(__AVX512F__)
  w.push_back(16);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  w.push_back(8);
#endif
  w.push_back(1);
  return w;
}

Args make_args(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
               const at::Tensor& table, const at::Tensor& q_pos, const at::Tensor& meta,
               double scale, int64_t window, int64_t block_size, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 4 && k_pool.dim() == 3 && v_pool.dim() == 3, "bad ranks");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_pool.scalar_type() == at::kFloat &&
                  v_pool.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "float32 only");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && out.is_contiguous() &&
                  table.is_contiguous() && meta.is_contiguous(),
              "pools, table, meta and out must be contiguous");
  TORCH_CHECK(table.scalar_type() == at::kLong && q_pos.scalar_type() == at::kLong &&
                  meta.scalar_type() == at::kLong,
              "int64 tables");
  Args a;
  a.q = q.data_ptr<float>();
  a.k = k_pool.data_ptr<float>();
  a.v = v_pool.data_ptr<float>();
  a.table = table.data_ptr<int64_t>();
  a.q_pos = q_pos.data_ptr<int64_t>();
  a.meta = meta.data_ptr<int64_t>();
  a.out = out.data_ptr<float>();
  const int64_t B = q.size(0);
  a.H = q.size(1);
  a.L = q.size(2);
  a.E = q.size(3);
  a.G = k_pool.size(1);
  a.Ev = v_pool.size(2);
  a.nb = table.size(1);
  a.bs = block_size;
  a.window = window;
  a.qs0 = q.stride(0);
  a.qs1 = q.stride(1);
  a.qs2 = q.stride(2);
  a.qs3 = q.stride(3);
  a.ps0 = q_pos.size(0) == 1 ? 0 : q_pos.stride(0);
  a.ps1 = q_pos.stride(1);
  a.scale = static_cast<float>(scale);
  TORCH_CHECK(a.G > 0 && a.H % a.G == 0 && k_pool.size(2) == a.E, "head counts or dims disagree");
  TORCH_CHECK(out.size(0) == B && out.size(1) == a.H && out.size(2) == a.L &&
                  out.size(3) == a.Ev && table.size(0) == B && meta.size(0) == B,
              "output, table or meta of the wrong shape");
  return a;
}

void paged_attention_simd(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                          const at::Tensor& table, const at::Tensor& q_pos, const at::Tensor& meta,
                          double scale, int64_t window, int64_t block_size, const at::Tensor& out,
                          int64_t width) {
  const Args a = make_args(q, k_pool, v_pool, table, q_pos, meta, scale, window, block_size, out);
  const int64_t B = q.size(0);
  if (B == 0 || a.L == 0) return;
#if defined(__AVX512F__)
  if (width == 16) return Kernel<Avx512>::run(a, B);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (width == 8) return Kernel<Avx2>::run(a, B);
#endif
  TORCH_CHECK(width == 1, "SIMD width ", width, " is not in this build");
  Kernel<Scalar>::run(a, B);
}

void paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                     const at::Tensor& table, const at::Tensor& q_pos, const at::Tensor& meta,
                     double scale, int64_t window, int64_t block_size, const at::Tensor& out) {
  paged_attention_simd(q, k_pool, v_pool, table, q_pos, meta, scale, window, block_size, out,
                       widths().front());
}

at::Tensor vexp(const at::Tensor& x, int64_t width) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "float32 only");
#if defined(__AVX512F__)
  if (width == 16) return Kernel<Avx512>::exp_of(x);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (width == 8) return Kernel<Avx2>::exp_of(x);
#endif
  TORCH_CHECK(width == 1, "SIMD width ", width, " is not in this build");
  return Kernel<Scalar>::exp_of(x);
}

}  // namespace

TORCH_LIBRARY(attnlab_paged, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor table, Tensor q_pos, "
      "Tensor meta, float scale, int window, int block_size, Tensor(a!) out) -> ()",
      &paged_attention);
  m.def(
      "paged_attention_simd(Tensor q, Tensor k_pool, Tensor v_pool, Tensor table, "
      "Tensor q_pos, Tensor meta, float scale, int window, int block_size, Tensor(a!) out, "
      "int width) -> ()",
      &paged_attention_simd);
  m.def("simd_widths() -> int[]", &widths);
  m.def("vexp(Tensor x, int width) -> Tensor", &vexp);
}
