"""A fused dequantize-and-multiply CPU kernel for a few rows of activations (decoding).

torch's weight-only kernels are built for GEMM shapes: at one row (a decode step) the
grouped int8 layout of GGUF's Q8_0 needs one ``_weight_int8pack_mm`` call per group of 32
input features, and the int4 kernel works in bfloat16 only to be fast. This kernel reads
the quantized blocks once, expands each group of 32 levels in registers and accumulates
in float32, for every output feature in parallel (OpenMP over ``N``):

``y[r, n] = sum_g s[n, g] * sum_{j<32} x[r, 32 g + j] * q[n, 32 g + j] (+ m[n, g] * sum_j x[r, 32 g + j])``

for int8 levels (Q8_0 and per-channel int8: the scale of a group of any multiple of 32)
and 4-bit levels (Q4_0/Q4_1 and int4 in groups of 32/64/128...), whose bytes are repacked
once into GGUF's order inside a block of 32 (byte ``j`` holds element ``j`` in its low
nibble and element ``j + 16`` in its high one), so the loop needs no shuffle.

The C source below is compiled once per machine with the system C compiler (``cc``,
``-O3 -fopenmp`` and the SIMD flags torch reports for this CPU:
``torch.backends.cpu.get_cpu_capability()``), into ``$TMPDIR/attnlab-kernels-<uid>``,
and loaded with ``ctypes``; it runs on torch's own OpenMP runtime and thread count. It
is registered as the custom op ``attnlab::qgemv`` so a compiled decode step calls it
without a graph break. Where no compiler is found or the build fails,
:func:`unavailable` says why and the kernel is not offered.

Shape notation: ``M`` rows of activations, ``K`` input features, ``N`` output features,
``G`` the scales' group size.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["qgemv", "repack_int4", "unavailable"]

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* y[M, N] = x[M, K] @ W^T; W's levels in blocks of 32 along K, one scale per group of gs
   (a multiple of 32) and, for 4-bit levels, one minimum: w = s * q + m. GCC/clang vector
   types: one 16-float vector per half block (a zmm register with AVX-512, two ymm with
   AVX2, scalar code elsewhere). */
typedef float f16v __attribute__((vector_size(64)));
typedef uint8_t u8v __attribute__((vector_size(16)));
typedef int8_t i8v __attribute__((vector_size(16)));
typedef int32_t i32v __attribute__((vector_size(64)));
/* bytes -> int32 -> float, in two steps: one vpmovzxbd/vpmovsxbd and one vcvtdq2ps */
#define TO_F(v) __builtin_convertvector(__builtin_convertvector((v), i32v), f16v)
/* signed bytes through the unsigned path (GCC scalarises a signed byte widening):
   q = (q ^ 0x80, as unsigned) - 128 */
#define TO_F_SIGNED(v) __builtin_convertvector( \
    __builtin_convertvector((u8v)(v) ^ 0x80, i32v) - 128, f16v)

static inline f16v load_f(const float *p) { f16v v; memcpy(&v, p, 64); return v; }
static inline float hsum(f16v v) {
  float t = 0.0f;
  for (int j = 0; j < 16; ++j) t += v[j];
  return t;
}

static float q8_row(const float *restrict xr, const int8_t *restrict qn,
                    const float *restrict sn, int64_t S, int64_t per) {
  f16v acc = {0};
  for (int64_t g = 0; g < S; ++g) { /* scale groups, then their blocks: no division */
    f16v t = {0};
    for (int64_t b = g * per; b < (g + 1) * per; ++b) {
      i8v lo, hi;
      memcpy(&lo, qn + b * 32, 16);
      memcpy(&hi, qn + b * 32 + 16, 16);
      t += load_f(xr + b * 32) * TO_F_SIGNED(lo) + load_f(xr + b * 32 + 16) * TO_F_SIGNED(hi);
    }
    acc += sn[g] * t;
  }
  return hsum(acc);
}

static float q4_row(const float *restrict xr, const uint8_t *restrict qn,
                    const float *restrict sn, int64_t S, int64_t per) {
  f16v acc = {0};
  for (int64_t g = 0; g < S; ++g) {
    f16v t = {0};
    for (int64_t b = g * per; b < (g + 1) * per; ++b) {
      u8v v;
      memcpy(&v, qn + b * 16, 16);
      t += load_f(xr + b * 32) * TO_F(v & 15) + load_f(xr + b * 32 + 16) * TO_F(v >> 4);
    }
    acc += sn[g] * t;
  }
  return hsum(acc);
}

void attnlab_q8_gemv(const float *x, const int8_t *q, const float *s, float *y, int64_t M,
                     int64_t N, int64_t K, int64_t gs, int threads) {
  const int64_t S = K / gs, per = gs / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t r = 0; r < M; ++r)
      y[r * N + n] = q8_row(x + r * K, q + n * K, s + n * S, S, per);
}

void attnlab_q4_gemv(const float *x, const uint8_t *q, const float *s, const float *m,
                     float *y, int64_t M, int64_t N, int64_t K, int64_t gs, int threads) {
  const int64_t S = K / gs, per = gs / 32;
  float *xs = (float *)malloc(sizeof(float) * (size_t)(M * S + 1)); /* [M, S] group sums */
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < S; ++g) {
      float t = 0.0f;
      for (int64_t k = 0; k < gs; ++k) t += x[r * K + g * gs + k];
      xs[r * S + g] = t;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t r = 0; r < M; ++r) {
      float t = q4_row(x + r * K, q + n * (K / 2), s + n * S, S, per);
      for (int64_t g = 0; g < S; ++g) t += m[n * S + g] * xs[r * S + g];
      y[r * N + n] = t;
    }
  free(xs);
}
"""

_SIMD_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma",
               "-mprefer-vector-width=512"],
    "AVX2": ["-mavx2", "-mfma"],
}  # fmt: skip


def _compiler() -> str | None:
    return next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The compiled kernels, or why there are none (built once per machine, then cached)."""
    cc = _compiler()
    if cc is None:
        return "no C compiler (cc, gcc, clang) on PATH"
    flags = ["-O3", "-fPIC", "-shared", "-fopenmp", "-std=gnu99"]
    flags += _SIMD_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
    tag = hashlib.sha256((_SOURCE + " ".join([cc, *flags])).encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"attnlab-kernels-{os.getuid()}"
    lib = folder / f"qgemv-{tag}.so"
    if not lib.exists():
        folder.mkdir(parents=True, exist_ok=True)
        # per-process names (parallel test workers may build at once), renamed when whole
        src = folder / f"qgemv-{tag}.{os.getpid()}.c"
        src.write_text(_SOURCE)
        tmp = folder / f"qgemv-{tag}.{os.getpid()}.so"
        try:
            subprocess.run([cc, *flags, str(src), "-o", str(tmp)], check=True,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        except (OSError, subprocess.SubprocessError) as e:
            err = getattr(e, "stderr", "") or str(e)
            return f"building the fused kernel with {cc} failed: {err.strip()[:300]}"
        finally:
            src.unlink(missing_ok=True)
        os.replace(tmp, lib)
    try:
        dll = ctypes.CDLL(str(lib))
    except OSError as e:
        return f"loading the fused kernel failed: {e}"
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    dll.attnlab_q8_gemv.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
    dll.attnlab_q4_gemv.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
    dll.attnlab_q8_gemv.restype = dll.attnlab_q4_gemv.restype = None
    return dll


_STATE: dict[str, str | None] = {}  # "why": the build's verdict, once made


def unavailable() -> str | None:
    """Why the fused kernel cannot run on this machine, or None (builds it on first call;
    inside a compiled graph only the verdict of an earlier eager call is read)."""
    if "why" not in _STATE:
        if torch.compiler.is_compiling():
            return "the fused kernel is built eagerly, before a graph is traced"
        lib = _library()
        _STATE["why"] = lib if isinstance(lib, str) else None
    return _STATE["why"]


def repack_int4(levels: Tensor) -> Tensor:
    """Levels ``[N, K]`` in ``0..15`` -> ``[N, K/2]`` uint8 in GGUF's in-block order
    (byte ``j`` of a block of 32: element ``j`` low, ``j + 16`` high)."""
    n, k = levels.shape
    blocks = levels.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def _run(x: Tensor, q: Tensor, s: Tensor, m: Tensor | None, group_size: int) -> Tensor:
    lib = _library()
    if isinstance(lib, str):
        raise RuntimeError(lib)
    x = x.to(torch.float32).contiguous()
    rows, k = x.shape
    n = s.shape[0]
    y = torch.empty(rows, n, dtype=torch.float32)
    threads = torch.get_num_threads()
    if m is None:
        lib.attnlab_q8_gemv(x.data_ptr(), q.data_ptr(), s.data_ptr(), y.data_ptr(),
                            rows, n, k, group_size, threads)  # fmt: skip
    else:
        lib.attnlab_q4_gemv(x.data_ptr(), q.data_ptr(), s.data_ptr(), m.data_ptr(),
                            y.data_ptr(), rows, n, k, group_size, threads)  # fmt: skip
    return y


@torch.library.custom_op("attnlab::qgemv", mutates_args=())
def _qgemv_op(x: Tensor, q: Tensor, s: Tensor, m: Tensor | None, group_size: int) -> Tensor:
    return _run(x, q, s, m, group_size)


@_qgemv_op.register_fake
def _(x: Tensor, q: Tensor, s: Tensor, m: Tensor | None, group_size: int) -> Tensor:
    return x.new_empty(x.shape[0], s.shape[0], dtype=torch.float32)


def qgemv(x: Tensor, q: Tensor, s: Tensor, m: Tensor | None, group_size: int) -> Tensor:
    """``x [M, K] @ W^T -> [M, N]`` in float32, ``W`` as the kernel reads it.

    Args:
        x: activations (any float dtype; multiplied in float32).
        q: int8 levels ``[N, K]``, or 4-bit levels ``[N, K/2]`` uint8 from :func:`repack_int4`.
        s: float32 scales ``[N, K/G]``.
        m: float32 minimums ``[N, K/G]`` for 4-bit levels, None for int8.
        group_size: ``G``, a multiple of 32 dividing ``K``.
    """
    if torch.compiler.is_compiling():  # an opaque op inside a compiled graph
        return _qgemv_op(x, q, s, m, group_size)
    return _run(x, q, s, m, group_size)  # eagerly: no dispatcher round trip
