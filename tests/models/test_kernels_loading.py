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


def test_the_build_key_covers_every_source_header_and_flag(tmp_path, monkeypatch):
    """Editing a header (simd.h's exp) or a compile flag (-ffp-contract=off) changes the
    kernels' bits, so it must change the cached library's name: a stale build is never reused
    under a new arithmetic revision. A fake compiler records each build."""
    from kvreuse.models.kernels import native

    src = tmp_path / "src"
    src.mkdir()
    for p in (*native.SOURCES, *native.HEADERS):
        (src / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(native, "SOURCES", tuple(src / p.name for p in native.SOURCES))
    monkeypatch.setattr(native, "HEADERS", tuple(src / p.name for p in native.HEADERS))
    fake = tmp_path / "fake-g++"
    fake.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && { echo fake 1; exit 0; }\nfor a; do out=$a; done\ntouch "$out"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setattr(native, "_compile_command", lambda c, s, out: [c, "-o", str(out)])
    cache = tmp_path / "cache"
    first = native.build_library(cache)
    assert native.build_library(cache) == first  # unchanged: the cached build
    (src / "simd.h").write_text((src / "simd.h").read_text() + "\n// changed\n")
    second = native.build_library(cache)
    monkeypatch.setattr(native, "FLAGS", tuple(f for f in native.FLAGS if f != "-ffp-contract=off"))
    third = native.build_library(cache)
    assert len({first, second, third}) == 3
