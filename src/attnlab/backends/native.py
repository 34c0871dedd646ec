"""attnlab's own CPU kernels: built once per machine with the system's C++ compiler, cached.

Three kernels: paged attention that reads a paged KV pool in place
(``csrc/paged_attention.cpp``, the ``paged_kernel`` backend, ``torch.ops.attnlab_paged``),
and the quantized-weight GEMVs (``csrc/qgemv.cpp`` and the tiled VNNI variant
``csrc/qgemv_tiled.cpp``, :mod:`attnlab.backends.qmatmul_cpu`, ``torch.ops.attnlab_q`` and
``attnlab_qt``), and single-query attention over a contiguous cache for decode steps
(``csrc/decode_attention.cpp``, :mod:`attnlab.backends.decode_attention`,
``torch.ops.attnlab_dec``; the local headers a source includes are part of the cache key). Each
includes only the light ATen/``torch/library.h`` headers (no pybind11, no ``torch/extension.h``), so a first build
takes a few seconds of one core; the shared object is cached under
``$ATTNLAB_KERNEL_CACHE`` (default ``$XDG_CACHE_HOME/attnlab/kernels``, else
``~/.cache/attnlab/kernels``) in a folder named by a hash of the source, the torch
version, the compiler flags and the CPU's feature flags (it is built with
``-march=native``, or ``-march=$ATTNLAB_KERNEL_MARCH``: e.g. ``haswell`` builds the AVX2
code paths on an AVX-512 machine, to check them), and loaded as torch custom ops.

A machine without a compiler, or a build that fails or takes longer than
``ATTNLAB_KERNEL_BUILD_TIMEOUT`` seconds (default 600), leaves the kernel unavailable: the
backend's check then says why and ``auto`` ranks the other backends;
``ATTNLAB_NO_KERNELS=1`` turns the kernels off. Builds are serialised by a file lock, and
the shared object is written atomically (built beside, then renamed).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = ["kernel_dir", "kernel_status", "load_paged", "paged_status"]

_SOURCES = {
    "paged": "paged_attention.cpp",
    "qgemv": "qgemv.cpp",
    "qtiled": "qgemv_tiled.cpp",
    "decode": "decode_attention.cpp",
}
_FLAGS = ("-O3", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-w")
_state: dict[str, str | None] = {}


def kernel_dir() -> Path:
    """The cache folder of the built kernels."""
    env = os.environ.get("ATTNLAB_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "attnlab" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _march() -> str:
    return os.environ.get("ATTNLAB_KERNEL_MARCH") or "native"


def _command(cxx: str, source: Path, out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    lib = library_paths()[0]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        cxx,
        *_FLAGS,
        f"-march={_march()}",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in include_paths()),
        str(source),
        "-o",
        str(out),
        f"-L{lib}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{lib}",
    ]


def _build(name: str) -> str | None:
    """Build (or find) and load kernel ``name``; None when loaded, else why not."""
    if os.environ.get("ATTNLAB_NO_KERNELS") == "1":
        return "attnlab's C++ kernels are turned off (ATTNLAB_NO_KERNELS=1)"
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None or shutil.which(cxx) is None:
        return "no C++ compiler found to build the kernel (set CXX)"
    source = Path(__file__).with_name("csrc") / _SOURCES[name]
    if not source.exists():
        return f"the kernel's source {source} is missing"
    flags = " ".join([*_FLAGS, _march()])
    text = source.read_text()
    headers = [  # the local headers it includes are part of the key
        (source.parent / h).read_bytes()
        for h in re.findall(r'^#include "([^"]+)"', text, flags=re.M)
        if (source.parent / h).exists()
    ]
    key = hashlib.sha256(
        b"\0".join(
            x.encode() if isinstance(x, str) else x
            for x in (source.read_bytes(), *headers, torch.__version__, flags, cxx, _cpu_flags())
        )
    ).hexdigest()[:16]
    folder = kernel_dir() / f"{name}-{key}"
    so = folder / f"{source.stem}.so"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; others wait, then load
            if not so.exists():
                timeout = float(os.environ.get("ATTNLAB_KERNEL_BUILD_TIMEOUT", "600"))
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
                os.close(fd)
                try:
                    done = subprocess.run(
                        _command(cxx, source, Path(tmp)),
                        capture_output=True,
                        text=True,
                        timeout=timeout,
                    )
                    if done.returncode != 0:
                        tail = done.stderr.strip().splitlines()[-3:]
                        return f"the kernel's build failed: {' / '.join(tail)}"
                    os.replace(tmp, so)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
    except subprocess.TimeoutExpired:
        return "the kernel's build took longer than ATTNLAB_KERNEL_BUILD_TIMEOUT seconds"
    except OSError as e:
        return f"the kernel could not be built in {folder}: {e}"
    try:
        torch.ops.load_library(str(so))
    except (OSError, RuntimeError) as e:
        return f"the built kernel {so} does not load: {e}"
    return None


def kernel_status(name: str) -> str | None:
    """None when kernel ``name`` (``"paged"``, ``"qgemv"``, ``"qtiled"`` or ``"decode"``) is loaded (building it once
    if needed), else why it is unavailable (the answer is kept for the process)."""
    if name not in _state:
        _state[name] = _build(name)
    return _state[name]


def paged_status() -> str | None:
    """:func:`kernel_status` of the paged-attention kernel."""
    return kernel_status("paged")


def load_paged() -> object:
    """``torch.ops.attnlab_paged.paged_attention``.

    Raises:
        RuntimeError: the kernel is unavailable (with the reason).
    """
    reason = paged_status()
    if reason is not None:
        raise RuntimeError(reason)
    return torch.ops.attnlab_paged.paged_attention
