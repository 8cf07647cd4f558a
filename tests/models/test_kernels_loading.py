"""kvreuse.models.kernels.native: one process loads the kernels' library once, whatever its
cache dir or source says later (a second ``TORCH_LIBRARY(kvreuse, ...)`` aborts the process)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvreuse.models.kernels import native_kernels

SCRIPT = """
import os, shutil, sys
from kvreuse.models.kernels import native
first = native.native_kernels()
os.makedirs(sys.argv[1])
shutil.copy(first.path, sys.argv[1])  # the same build in another cache: a second library to load
os.environ["KVREUSE_KERNEL_CACHE"] = sys.argv[1]
native.native_kernels.cache_clear()
second = native.native_kernels()
print(first.path == second.path)
"""


@pytest.mark.skipif(native_kernels() is None, reason="kvreuse's native kernels are not built on this machine")
def test_a_second_lookup_keeps_the_loaded_library(tmp_path):
    """After the cache dir changes (or gemv.cpp is edited) a new lookup returns the library
    already loaded instead of loading another build, which aborted the process."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "other-cache")], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True"]
