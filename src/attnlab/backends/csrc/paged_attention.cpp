// Paged attention on the CPU that reads a paged KV pool in place (no gathered copy).
//
// PagedAttention (Kwon et al., 2023, section 4.1): each sequence's keys/values sit in
// fixed-size blocks of one pool per layer, listed in order by its block table. This
// kernel walks a row's blocks through its table and keeps FlashAttention's online
// softmax (Dao et al., 2022; Milakov & Gimelshein, 2018) per query and head, so no key
// is copied out of the pool and no score matrix is built.
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
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kQueryTile = 16;
constexpr int64_t kTransposeFrom = 4;  // queries of a tile from which keys are transposed

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

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

// One query position w of row b, every head: the row's key blocks are read in order
// (each slot's [G, E] keys and [G, Ev] values are one contiguous run of the pool).
void one_query(const Args& a, int64_t b, int64_t w, std::vector<float>& acc,
               std::vector<float>& scores, std::vector<float>& qbuf) {
  const int64_t rep = a.H / a.G;
  const int64_t length = a.meta[b * 3], offset = a.meta[b * 3 + 1];
  const int64_t first = a.meta[b * 3 + 2] * a.bs;
  const int64_t t = a.q_pos[b * a.ps0 + w * a.ps1];
  const int64_t hi = std::min(length - 1, t - offset);  // last key index seen
  int64_t lo = first;
  if (a.window >= 0) lo = std::max(lo, t - a.window - offset);
  if (hi < lo) {
    for (int64_t h = 0; h < a.H; ++h) {
      float* o = a.out + ((b * a.H + h) * a.L + w) * a.Ev;
      std::fill(o, o + a.Ev, 0.f);
    }
    return;
  }
  for (int64_t h = 0; h < a.H; ++h) {  // the queries, contiguous: [H, E]
    const float* qv = a.q + b * a.qs0 + h * a.qs1 + w * a.qs2;
    for (int64_t e = 0; e < a.E; ++e) qbuf[h * a.E + e] = qv[e * a.qs3];
  }
  std::vector<float> m(a.H, -std::numeric_limits<float>::infinity()), l(a.H, 0.f);
  std::fill(acc.begin(), acc.end(), 0.f);
  for (int64_t blk = lo / a.bs; blk <= hi / a.bs; ++blk) {
    const int64_t base = a.table[b * a.nb + blk] * a.bs;
    const int64_t j0 = std::max(lo, blk * a.bs), j1 = std::min(hi, blk * a.bs + a.bs - 1);
    const int64_t n = j1 - j0 + 1;
    for (int64_t j = 0; j < n; ++j) {  // scores [H, n]
      const float* kr = a.k + (base + (j0 + j) % a.bs) * a.G * a.E;
      for (int64_t h = 0; h < a.H; ++h)
        scores[h * a.bs + j] = dot(qbuf.data() + h * a.E, kr + (h / rep) * a.E, a.E) * a.scale;
    }
    for (int64_t h = 0; h < a.H; ++h) {  // the online softmax's rescale, then the weights
      float* sc = scores.data() + h * a.bs;
      float mb = m[h];
      for (int64_t j = 0; j < n; ++j) mb = std::max(mb, sc[j]);
      const float corr = std::exp(m[h] - mb);  // 0 on the first block (m = -inf)
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        sc[j] = std::exp(sc[j] - mb);
        sum += sc[j];
      }
      l[h] = l[h] * corr + sum;
      m[h] = mb;
      float* ac = acc.data() + h * a.Ev;
#pragma omp simd
      for (int64_t e = 0; e < a.Ev; ++e) ac[e] *= corr;
    }
    for (int64_t j = 0; j < n; ++j) {  // values, in the pool's order
      const float* vr = a.v + (base + (j0 + j) % a.bs) * a.G * a.Ev;
      for (int64_t h = 0; h < a.H; ++h) {
        const float p = scores[h * a.bs + j];
        const float* vh = vr + (h / rep) * a.Ev;
        float* ac = acc.data() + h * a.Ev;
#pragma omp simd
        for (int64_t e = 0; e < a.Ev; ++e) ac[e] += p * vh[e];
      }
    }
  }
  for (int64_t h = 0; h < a.H; ++h) {
    float* o = a.out + ((b * a.H + h) * a.L + w) * a.Ev;
    const float inv = 1.f / l[h];
    const float* ac = acc.data() + h * a.Ev;
#pragma omp simd
    for (int64_t e = 0; e < a.Ev; ++e) o[e] = ac[e] * inv;
  }
}

// The keys each query of row b sees: indices lo .. hi of the row (hi < lo: none).
inline void key_range(const Args& a, int64_t b, int64_t w, int64_t& lo, int64_t& hi) {
  const int64_t length = a.meta[b * 3], offset = a.meta[b * 3 + 1];
  const int64_t t = a.q_pos[b * a.ps0 + w * a.ps1];
  hi = std::min(length - 1, t - offset);
  lo = a.meta[b * 3 + 2] * a.bs;
  if (a.window >= 0) lo = std::max(lo, t - a.window - offset);
}

// Queries w0 .. w1 - 1 of row b, every head, over the row's key blocks in order. Each
// block's keys are transposed once into kt [G, E, bs], so a query's scores against the
// block are E vector multiply-adds across its keys; values are added across Ev.
struct Work {
  std::vector<float> kt, scores, q, m, l, acc;
  Work(const Args& a)
      : kt(a.G * a.E * a.bs), scores(a.bs), q(kQueryTile * a.H * a.E),
        m(kQueryTile * a.H), l(kQueryTile * a.H), acc(kQueryTile * a.H * a.Ev) {}
};

void query_tile(const Args& a, int64_t b, int64_t w0, int64_t w1, Work& s) {
  const int64_t rep = a.H / a.G, nq = w1 - w0, bs = a.bs;
  int64_t lo_all = std::numeric_limits<int64_t>::max(), hi_all = -1;
  for (int64_t w = w0; w < w1; ++w) {
    int64_t lo, hi;
    key_range(a, b, w, lo, hi);
    if (hi >= lo) {
      lo_all = std::min(lo_all, lo);
      hi_all = std::max(hi_all, hi);
    }
    for (int64_t h = 0; h < a.H; ++h) {  // the queries, contiguous, pre-scaled
      const float* qv = a.q + b * a.qs0 + h * a.qs1 + w * a.qs2;
      float* qd = s.q.data() + ((w - w0) * a.H + h) * a.E;
      for (int64_t e = 0; e < a.E; ++e) qd[e] = qv[e * a.qs3] * a.scale;
    }
  }
  std::fill(s.m.begin(), s.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.end(), 0.f);
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  for (int64_t blk = hi_all < 0 ? 1 : lo_all / bs; blk <= hi_all / bs && hi_all >= 0; ++blk) {
    const int64_t base = a.table[b * a.nb + blk] * bs;
    const int64_t b0 = std::max(lo_all, blk * bs), b1 = std::min(hi_all, blk * bs + bs - 1);
    for (int64_t j = b0; j <= b1; ++j) {  // kt[g][e][j % bs]
      const float* kr = a.k + (base + j % bs) * a.G * a.E;
      for (int64_t g = 0; g < a.G; ++g)
        for (int64_t e = 0; e < a.E; ++e) s.kt[(g * a.E + e) * bs + j % bs] = kr[g * a.E + e];
    }
    for (int64_t w = w0; w < w1; ++w) {
      int64_t lo, hi;
      key_range(a, b, w, lo, hi);
      const int64_t j0 = std::max(lo, blk * bs), j1 = std::min(hi, blk * bs + bs - 1);
      if (j1 < j0) continue;
      const int64_t c0 = j0 % bs, n = j1 - j0 + 1;
      for (int64_t h = 0; h < a.H; ++h) {
        const int64_t i = (w - w0) * a.H + h;
        const float* qd = s.q.data() + i * a.E;
        const float* kt = s.kt.data() + (h / rep) * a.E * bs + c0;
        float* sc = s.scores.data();
        std::fill(sc, sc + n, 0.f);
        for (int64_t e = 0; e < a.E; ++e) {
          const float qe = qd[e];
          const float* ke = kt + e * bs;
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) sc[j] += qe * ke[j];
        }
        float mb = s.m[i];
        for (int64_t j = 0; j < n; ++j) mb = std::max(mb, sc[j]);
        const float corr = std::exp(s.m[i] - mb);  // 0 on the first block (m = -inf)
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          sc[j] = std::exp(sc[j] - mb);
          sum += sc[j];
        }
        s.l[i] = s.l[i] * corr + sum;
        s.m[i] = mb;
        float* ac = s.acc.data() + i * a.Ev;
#pragma omp simd
        for (int64_t e = 0; e < a.Ev; ++e) ac[e] *= corr;
        for (int64_t j = 0; j < n; ++j) {
          const float p = sc[j];
          const float* vh = a.v + ((base + c0 + j) * a.G + h / rep) * a.Ev;
#pragma omp simd
          for (int64_t e = 0; e < a.Ev; ++e) ac[e] += p * vh[e];
        }
      }
    }
  }
  for (int64_t w = w0; w < w1; ++w) {
    for (int64_t h = 0; h < a.H; ++h) {
      const int64_t i = (w - w0) * a.H + h;
      float* o = a.out + ((b * a.H + h) * a.L + w) * a.Ev;
      const float inv = s.l[i] > 0.f ? 1.f / s.l[i] : 0.f;  // no key seen: zeros
      const float* ac = s.acc.data() + i * a.Ev;
#pragma omp simd
      for (int64_t e = 0; e < a.Ev; ++e) o[e] = ac[e] * inv;
    }
  }
}

void paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
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
  TORCH_CHECK(a.H % a.G == 0 && k_pool.size(2) == a.E, "head counts or dims disagree");
  TORCH_CHECK(out.size(0) == B && out.size(1) == a.H && out.size(2) == a.L &&
                  out.size(3) == a.Ev && table.size(0) == B && meta.size(0) == B,
              "output, table or meta of the wrong shape");
  const int64_t tiles = (a.L + kQueryTile - 1) / kQueryTile;
  at::parallel_for(0, B * tiles, 1, [&](int64_t begin, int64_t end) {
    Work work(a);
    std::vector<float> acc(a.H * a.Ev), scores(a.H * a.bs), qbuf(a.H * a.E);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t tile = i % tiles, b = i / tiles;
      const int64_t w0 = tile * kQueryTile, w1 = std::min(a.L, w0 + kQueryTile);
      if (w1 - w0 >= kTransposeFrom) {
        query_tile(a, b, w0, w1, work);  // a chunk: each block's keys transposed once
      } else {
        for (int64_t w = w0; w < w1; ++w) one_query(a, b, w, acc, scores, qbuf);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(attnlab_paged, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor table, Tensor q_pos, "
      "Tensor meta, float scale, int window, int block_size, Tensor(a!) out) -> ()",
      &paged_attention);
}
