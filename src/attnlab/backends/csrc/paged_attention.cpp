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
// a few rows (decode: M = rep) a dot product per (key, row). The softmax runs across the
// M rows in SIMD lanes, one rescale of the accumulators per key tile, and the values are
// added as P^T [M, keys] x V [keys, Ev], register-blocked 4 rows x 4 vectors.
// SIMD: the same code is built for AVX-512, AVX2+FMA and scalar floats, as -march allows;
// the widest runs (`paged_attention_simd` picks one: tests compare them). exp is a
// polynomial: max relative error 1.2e-7 (1 ulp) against float64 on [-87.3, 88.3]
// (tests/backends/test_paged_kernel_simd.py); below -87.34 it is 0 (true value < 2^-126).
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

#include "paged_simd.h"  // Scalar, Avx2, Avx512: the SIMD types and their exp

struct Args {
  const float *q, *k, *v;
  const int64_t *table, *q_pos, *meta;
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
  std::vector<float> q, s, m, l, corr, acc, lof, hif;  // lof/hif: each row's range
  std::vector<int64_t> lo, hi;
  int64_t lo_max = 0, hi_min = 0;  // every row sees keys lo_max .. hi_min
  std::vector<const float*> kp, vp, kn, vn;  // this tile's keys/values, the next's
  int64_t n_next = 0;
  Work(const Args& a, int64_t mp, int64_t evp)
      : q(a.G * round_up(a.E, 16) * mp), s((kKeyTile + 4) * mp), m(a.G * mp), l(a.G * mp),
        corr(mp), acc(a.G * mp * evp), lof(mp), hif(mp), lo(kQueryTile), hi(kQueryTile),
        kp(kKeyTile + 4), vp(kKeyTile + 4), kn(kKeyTile), vn(kKeyTile) {}
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

  // Key j of the next tile (its key and value rows of head g) fetched into the caches
  // while key j of this tile is computed: the loads otherwise wait on memory.
  static void prefetch(const Work& s, int64_t j, int64_t E, int64_t Ev) {
    if (j >= s.n_next) return;
    for (int64_t e = 0; e < E; e += 16) __builtin_prefetch(s.kn[j] + e);
    for (int64_t e = 0; e < Ev; e += 16) __builtin_prefetch(s.vn[j] + e);
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
    s.lo_max = *std::max_element(s.lo.begin(), s.lo.begin() + nq);
    s.hi_min = *std::min_element(s.hi.begin(), s.hi.begin() + nq);
    for (int64_t m = 0; m < mp; ++m) {  // as floats (exact below 2^24), pad rows: all keys
      s.lof[m] = m < M ? float(s.lo[m / rep]) : -1e30f;
      s.hif[m] = m < M ? float(s.hi[m / rep]) : 1e30f;
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
    int64_t slot[kKeyTile], next[kKeyTile];  // this tile's keys' slots, the next's
    auto slots = [&](int64_t t0, int64_t n, int64_t* out) {
      for (int64_t j = 0; j < n; ++j)
        out[j] = a.table[b * a.nb + (t0 + j) / a.bs] * a.bs + (t0 + j) % a.bs;
    };
    if (hi_all >= 0) slots(lo_all, std::min(kKeyTile, hi_all - lo_all + 1), next);
    for (int64_t t0 = lo_all; hi_all >= 0 && t0 <= hi_all; t0 += kKeyTile) {
      const int64_t n = std::min(kKeyTile, hi_all - t0 + 1);
      std::copy(next, next + n, slot);
      s.n_next = std::max<int64_t>(0, std::min(kKeyTile, hi_all - t0 - n + 1));
      slots(t0 + n, s.n_next, next);
      for (int64_t g = 0; g < a.G; ++g) {
        for (int64_t j = 0; j < n + 4; ++j) {  // past n: key 0 again (scores unused)
          const int64_t sl = slot[j < n ? j : 0];
          s.kp[j] = a.k + (sl * rows_per_key + g) * a.E;
          s.vp[j] = a.v + (sl * rows_per_key + g) * a.Ev;
        }
        for (int64_t j = 0; j < s.n_next; ++j) {
          s.kn[j] = a.k + (next[j] * rows_per_key + g) * a.E;
          s.vn[j] = a.v + (next[j] * rows_per_key + g) * a.Ev;
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
        prefetch(s, j, a.E, a.Ev);
        for (int64_t c = 0; c < mp; c += W) V::store(sc + j * mp + c, V::zero());  // pads
        for (int64_t m = 0; m < M; ++m) {
          T acc = V::zero();
          for (int64_t e = 0; e < ep; e += W) acc = V::fma(V::load(q + m * ep + e), V::loadn(kr + e, a.E - e), acc);
          sc[j * mp + m] = V::hsum(acc);
        }
      }
    } else {
      const float* qt = s.q.data() + g * a.E * mp;
      for (int64_t j = 0; j < n; j += 4) {
        for (int64_t i = j; i < j + 4; ++i) prefetch(s, i, a.E, a.Ev);
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
    if (s.lo_max > t0 || s.hi_min < t0 + n - 1) {  // the pattern: keys outside a range
      for (int64_t j = 0; j < n; ++j) {
        const T idx = V::set1(float(t0 + j));
        for (int64_t c = 0; c < mp; c += W) {
          const T v = V::load(sc + j * mp + c);
          V::store(sc + j * mp + c, V::outside(v, idx, V::load(s.lof.data() + c), V::load(s.hif.data() + c)));
        }
      }
    }
    float* mr = s.m.data() + g * mp;
    float* lr = s.l.data() + g * mp;
    for (int64_t c = 0; c < mp; c += W) {  // online softmax across rows, once per tile
      const T m_old = V::load(mr + c);
      T mx = m_old;
      for (int64_t j = 0; j < n; ++j) mx = V::max(mx, V::load(sc + j * mp + c));
      const T base = V::base(mx);
      const T corr = V::exp(V::sub(m_old, base));
      T sum = V::zero();
      for (int64_t j = 0; j < n; ++j) {
        const T p = V::exp(V::sub(V::load(sc + j * mp + c), base));
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

Args make_args(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
               const at::Tensor& table, const at::Tensor& q_pos, const at::Tensor& meta,
               double scale, int64_t window, int64_t block_size, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 4 && k_pool.dim() == 3 && v_pool.dim() == 3, "bad ranks");
  for (const at::Tensor* t : {&q, &k_pool, &v_pool, &out})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "float32 only");
  for (const at::Tensor* t : {&table, &q_pos, &meta})
    TORCH_CHECK(t->scalar_type() == at::kLong, "int64 tables");
  for (const at::Tensor* t : {&k_pool, &v_pool, &out, &table, &meta})
    TORCH_CHECK(t->is_contiguous(), "pools, table, meta and out must be contiguous");
  const int64_t ps0 = q_pos.size(0) == 1 ? 0 : q_pos.stride(0);
  Args a{q.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
         table.data_ptr<int64_t>(), q_pos.data_ptr<int64_t>(), meta.data_ptr<int64_t>(),
         out.data_ptr<float>(), q.size(1), k_pool.size(1), q.size(2), q.size(3),
         v_pool.size(2), table.size(1), block_size, window, q.stride(0), q.stride(1),
         q.stride(2), q.stride(3), ps0, q_pos.stride(1), static_cast<float>(scale)};
  const int64_t B = q.size(0);
  TORCH_CHECK(a.G > 0 && a.H % a.G == 0 && k_pool.size(2) == a.E, "head counts or dims disagree");
  TORCH_CHECK(out.size(0) == B && out.size(1) == a.H && out.size(2) == a.L &&
                  out.size(3) == a.Ev && table.size(0) == B && meta.size(0) == B,
              "output, table or meta of the wrong shape");
  return a;
}

template <class F>
auto with_width(int64_t width, F f) {  // f(Kernel<V>{}) for the SIMD width asked for
#if defined(__AVX512F__)
  if (width == 16) return f(Kernel<Avx512>{});
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (width == 8) return f(Kernel<Avx2>{});
#endif
  TORCH_CHECK(width == 1, "SIMD width ", width, " is not in this build");
  return f(Kernel<Scalar>{});
}

void paged_attention_simd(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                          const at::Tensor& table, const at::Tensor& q_pos, const at::Tensor& meta,
                          double scale, int64_t window, int64_t block_size, const at::Tensor& out,
                          int64_t width) {
  const Args a = make_args(q, k_pool, v_pool, table, q_pos, meta, scale, window, block_size, out);
  if (q.size(0) == 0 || a.L == 0) return;
  with_width(width, [&](auto kernel) { decltype(kernel)::run(a, q.size(0)); });
}

void paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                     const at::Tensor& table, const at::Tensor& q_pos, const at::Tensor& meta,
                     double scale, int64_t window, int64_t block_size, const at::Tensor& out) {
  paged_attention_simd(q, k_pool, v_pool, table, q_pos, meta, scale, window, block_size, out,
                       widths().front());
}

at::Tensor vexp(const at::Tensor& x, int64_t width) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "float32 only");
  return with_width(width, [&](auto kernel) { return decltype(kernel)::exp_of(x); });
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
