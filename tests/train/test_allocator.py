"""Holding glibc's mmap threshold (what `attnlab finetune` does for its peak memory; the
effect on a training step is measured by benchmarks/finetune.py)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from attnlab.train.allocator import hold_mmap_threshold


def test_bad_thresholds_are_refused_by_name():
    for bad in (-1, 64 * 1024 * 1024, 1.5, True):
        with pytest.raises(ValueError, match="nbytes"):
            hold_mmap_threshold(bad)  # type: ignore[arg-type]


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_glibc_takes_the_threshold():
    code = "from attnlab.train.allocator import hold_mmap_threshold as h; print(h(), h(0))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]
