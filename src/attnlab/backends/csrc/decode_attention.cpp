// Attention of a few queries over every key of a contiguous KV cache (a decode step).
//
// A decode step asks one query per row and head to attend over the S keys written so
// far, with no mask (every key is in its past). torch's CPU flash kernel tiles that as
// it tiles a prompt and spends ~100 us a call on SmolLM2's 9 heads x 256 keys, whose
// 0.4 MB of keys and values take ~20 us to read. This kernel reads them once: for each
// (row, key/value head g, chunk of keys) the M = L * rep queries of g (GQA's group, Ainslie
// et al., 2023) share every key and value it loads; the scores go into a small buffer,
// the softmax is exact over the chunk (max, exp, sum), and the values are added as
// P^T [M, keys] x V [keys, Ev], register-blocked 4 rows x up to 4 vectors. Chunks of one
// (row, head) are merged with their maxima as FlashAttention-2's split-KV decoding does
// (Dao et al., 2023): o = sum_c e^(m_c - m) acc_c / sum_c e^(m_c - m) l_c.
//
// Shapes: B rows, H query heads, G key/value heads (H = G * rep), L queries, E key head
// dim, Ev value head dim, S keys.
//   q [B, H, L, E] float32 (any strides)
//   k [B, G, S, E], v [B, G, S, Ev] float32, the last dim contiguous (a prefix view of a
//     static cache [B, G, T, E] is one)
//   returns [B, H, L, Ev] float32, contiguous
// Every query sees every key. Work is split over (row, head, chunk) on torch's intra-op
// threads only when there is enough of it (a call below kSerialBytes of keys and values
// runs on the calling thread: a fork costs more than it saves). SIMD types and exp come
// from paged_simd.h (AVX-512, AVX2+FMA or scalar floats, as -march allows).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
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

#include "paged_simd.h"  // Scalar, Avx2, Avx512: the SIMD types and their exp

constexpr int64_t kMaxRows = 16;            // queries per key/value head (L * rep)
constexpr int64_t kSerialBytes = 256 << 10;  // below this, one thread
constexpr int64_t kMinChunk = 128;           // keys per chunk when split

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

struct Args {
  const float *q, *k, *v;
  int64_t H, G, L, E, Ev, S;
  int64_t qs0, qs1, qs2, qs3, ks0, ks1, ks2, vs0, vs1, vs2;
  float scale;
};

template <class V>
struct Kernel {
  static constexpr int W = V::W;
  using T = typename V::T;

  // acc[r][c..] += sum_j p[r][j] v_j for rows m0 .. m0+3, value vectors c .. c+NV-1.
  template <int NV>
  static void pv(const float* p, int64_t sp, int64_t m0, const Args& a, const float* vb,
                 int64_t j0, int64_t n, float* acc, int64_t evp, int64_t c) {
    T o[4][NV];
    for (int r = 0; r < 4; ++r)
      for (int u = 0; u < NV; ++u) o[r][u] = V::zero();
    for (int64_t j = 0; j < n; ++j) {
      const float* vr = vb + (j0 + j) * a.vs2;
      T vv[NV];
      for (int u = 0; u < NV; ++u) vv[u] = V::loadn(vr + (c + u) * W, a.Ev - (c + u) * W);
      for (int r = 0; r < 4; ++r) {
        const T pr = V::set1(p[(m0 + r) * sp + j]);
        for (int u = 0; u < NV; ++u) o[r][u] = V::fma(pr, vv[u], o[r][u]);
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int u = 0; u < NV; ++u) V::store(acc + (m0 + r) * evp + (c + u) * W, o[r][u]);
  }

  // Keys j0 .. j0+n-1 of row b, head g: part[m] = (max, sum, acc[evp]) per query row m.
  static void chunk(const Args& a, int64_t b, int64_t g, int64_t j0, int64_t n, float* part,
                    std::vector<float>& buf) {
    const int64_t rep = a.H / a.G, M = a.L * rep, Mp = round_up(M, 4);
    const int64_t ep = round_up(a.E, W), evp = round_up(a.Ev, W), sp = round_up(n, W);
    buf.assign(Mp * ep + Mp * sp + Mp * evp, 0.f);
    float* qb = buf.data();         // [Mp, ep] scaled queries (pad rows and lanes 0)
    float* p = qb + Mp * ep;        // [Mp, sp] scores, then probabilities (pad rows 0)
    float* acc = p + Mp * sp;       // [Mp, evp]
    for (int64_t m = 0; m < M; ++m) {  // m = l * rep + r: query head g * rep + r
      const int64_t h = g * rep + m % rep, l = m / rep;
      const float* qv = a.q + b * a.qs0 + h * a.qs1 + l * a.qs2;
      for (int64_t e = 0; e < a.E; ++e) qb[m * ep + e] = qv[e * a.qs3] * a.scale;
    }
    const float* kb = a.k + b * a.ks0 + g * a.ks1;
    for (int64_t j = 0; j < n; ++j) {  // every row's dot with key j (loaded once per row)
      const float* kr = kb + (j0 + j) * a.ks2;
      for (int64_t m = 0; m < M; ++m) {
        T s = V::zero();
        for (int64_t e = 0; e < ep; e += W)
          s = V::fma(V::load(qb + m * ep + e), V::loadn(kr + e, a.E - e), s);
        p[m * sp + j] = V::hsum(s);
      }
    }
    for (int64_t m = 0; m < M; ++m) {  // exact softmax over the chunk's keys
      float* row = p + m * sp;
      float mx = -kInf;
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, row[j]);
      const float base = mx == -kInf ? 0.f : mx;
      T sum = V::zero();
      int64_t j = 0;
      for (; j + W <= n; j += W) {
        const T e = V::exp(V::sub(V::load(row + j), V::set1(base)));
        V::store(row + j, e);
        sum = V::add(sum, e);
      }
      float tail = 0.f;
      for (; j < n; ++j) tail += (row[j] = Scalar::exp(row[j] - base));
      part[m * (2 + a.Ev)] = mx;
      part[m * (2 + a.Ev) + 1] = V::hsum(sum) + tail;
    }
    const float* vb = a.v + b * a.vs0 + g * a.vs1;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      for (int64_t c = 0; c < evp / W; c += 4) {
        switch (std::min<int64_t>(4, evp / W - c)) {
          case 4: pv<4>(p, sp, m0, a, vb, j0, n, acc, evp, c); break;
          case 3: pv<3>(p, sp, m0, a, vb, j0, n, acc, evp, c); break;
          case 2: pv<2>(p, sp, m0, a, vb, j0, n, acc, evp, c); break;
          default: pv<1>(p, sp, m0, a, vb, j0, n, acc, evp, c);
        }
      }
    }
    for (int64_t m = 0; m < M; ++m)
      std::memcpy(part + m * (2 + a.Ev) + 2, acc + m * evp, a.Ev * sizeof(float));
  }

  static void run(const Args& a, int64_t B, float* out) {
    const int64_t rep = a.H / a.G, M = a.L * rep, heads = B * a.G;
    const int64_t bytes = heads * a.S * (a.E + a.Ev) * int64_t(sizeof(float));
    const int64_t threads = at::get_num_threads();
    int64_t chunks = 1;
    if (bytes >= kSerialBytes && threads > 1 && heads < 2 * threads)
      chunks = std::max<int64_t>(1, std::min((2 * threads + heads - 1) / heads, a.S / kMinChunk));
    const int64_t per = (a.S + chunks - 1) / chunks, stride = M * (2 + a.Ev);
    std::vector<float> parts(heads * chunks * stride);
    auto work = [&](int64_t begin, int64_t end) {
      std::vector<float> buf;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t c = i % chunks, hg = i / chunks;
        const int64_t j0 = c * per, n = std::min(per, a.S - j0);
        if (n > 0) chunk(a, hg / a.G, hg % a.G, j0, n, parts.data() + i * stride, buf);
      }
    };
    const int64_t tasks = heads * chunks;
    if (bytes < kSerialBytes || threads == 1) {
      work(0, tasks);
    } else {
      at::parallel_for(0, tasks, 1, work);
    }
    for (int64_t hg = 0; hg < heads; ++hg) {  // merge the chunks of (row, head)
      const int64_t b = hg / a.G, g = hg % a.G;
      for (int64_t m = 0; m < M; ++m) {
        float mx = -kInf;
        for (int64_t c = 0; c * per < a.S; ++c)
          mx = std::max(mx, parts[(hg * chunks + c) * stride + m * (2 + a.Ev)]);
        float l = 0.f;
        float* o = out + ((b * a.H + g * rep + m % rep) * a.L + m / rep) * a.Ev;
        std::fill(o, o + a.Ev, 0.f);
        for (int64_t c = 0; c * per < a.S; ++c) {
          const float* pc = parts.data() + (hg * chunks + c) * stride + m * (2 + a.Ev);
          const float w = chunks == 1 ? 1.f : std::exp(pc[0] - mx);
          l += w * pc[1];
          for (int64_t e = 0; e < a.Ev; ++e) o[e] += w * pc[2 + e];
        }
        const float inv = l > 0.f ? 1.f / l : 0.f;
        for (int64_t e = 0; e < a.Ev; ++e) o[e] *= inv;
      }
    }
  }
};

at::Tensor decode_attention_simd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 double scale, int64_t width) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-d");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), "float32 CPU tensors only");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "k and v need a contiguous last dim");
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), G = k.size(1);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == G && v.size(2) == k.size(2) &&
                  k.size(3) == q.size(3) && G > 0 && H % G == 0,
              "shapes disagree: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(L * (H / G) <= kMaxRows, "at most ", kMaxRows, " queries per key/value head");
  at::Tensor out = at::empty({B, H, L, v.size(3)}, q.options());
  if (B == 0 || L == 0 || H == 0 || v.size(3) == 0) return out;
  TORCH_CHECK(k.size(2) > 0, "no keys");
  const Args a{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), H, G, L,
               q.size(3), v.size(3), k.size(2), q.stride(0), q.stride(1), q.stride(2),
               q.stride(3), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
               v.stride(2), static_cast<float>(scale)};
  float* o = out.data_ptr<float>();
#if defined(__AVX512F__)
  if (width == 16) return Kernel<Avx512>::run(a, B, o), out;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (width == 8) return Kernel<Avx2>::run(a, B, o), out;
#endif
  TORCH_CHECK(width == 1, "SIMD width ", width, " is not in this build");
  Kernel<Scalar>::run(a, B, o);
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale) {
  return decode_attention_simd(q, k, v, scale, widths().front());
}

}  // namespace

TORCH_LIBRARY(attnlab_dec, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def("decode_attention_simd(Tensor q, Tensor k, Tensor v, float scale, int width) -> Tensor");
  m.def("simd_widths() -> int[]", &widths);
}

TORCH_LIBRARY_IMPL(attnlab_dec, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_attention_simd", &decode_attention_simd);
}
