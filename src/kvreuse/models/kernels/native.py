"""kvreuse's own CPU kernels (``gemv.cpp``, ``attention.cpp``, ``layers.cpp``): built once per machine at first use
with the host compiler and ``-march=native``, cached, and loaded as ``torch.ops.kvreuse``.

Why built here and not shipped: the CPU changes between machines (AMX Xeon, AVX-512 EPYC,
AVX2-only EPYC) and ``-march=native`` picks the instruction set the kernels are fastest with on
this one; the build key folds in the CPU's flags, so a cached build is never loaded on another
kind of CPU. A build takes 11-16 s on 2 idle cores; its ``.so`` lives under ``$KVREUSE_KERNEL_CACHE`` (default
``~/.cache/kvreuse/kernels``).

Never fatal: no compiler, a failed build or ``KVREUSE_NATIVE_KERNELS=off`` leaves
:func:`native_kernels` returning None and the layers on PyTorch's own kernels (one log line says
why). A CPU without AVX2 gets None too (the portable C++ path is slower than PyTorch's).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

__all__ = ["NativeKernels", "native_kernels", "build_library", "kernel_cache_dir", "ENV_SWITCH", "ARITHMETIC_REVISION"]

log = logging.getLogger("kvreuse.kernels")

ENV_SWITCH = "KVREUSE_NATIVE_KERNELS"  # "off" / "0" / "false": PyTorch's kernels only
# The kernels' rounding revision, folded into every model fingerprint that uses them: raise it
# whenever a kernel's arithmetic changes (its outputs, so the KV it writes), so KV a disk, Redis or
# object store kept from an older build is never read as this build's. 2: fma-chain attention
# scores, vectorized exp in SiLU, 16-lane sums of squares in RMSNorm. 3: RoPE on the fused path
# by layers.cpp's ``rope_`` (x * cos rounded, then one rounding of the sum). 4: a GGUF Q4_0
# tensor keeps its own symmetric codes (``Int4Linear``: min-max codes re-derived before).
ARITHMETIC_REVISION = 4
SOURCES = tuple(Path(__file__).with_name(n) for n in ("gemv.cpp", "attention.cpp", "layers.cpp"))
HEADERS = tuple(Path(__file__).with_name(n) for n in ("bf16.h", "ops.h", "simd.h"))
FAST_ISAS = ("avx512vnni", "avx2")
# -ffp-contract=off: a * b + c rounds twice wherever it is written, so an inlined helper computes
# the same bits in every caller (the kernels' batch invariance); fma is written out where wanted.
# Part of the build key, as the sources and headers are: each changes the bits.
FLAGS = ("-O3", "-march=native", "-std=c++20", "-ffp-contract=off", "-fPIC", "-shared", "-fopenmp")


@dataclass(frozen=True)
class NativeKernels:
    """The loaded library: ``isa`` is the instruction set it was built for (``avx512vnni`` or
    ``avx2``); the ops are ``torch.ops.kvreuse.q4_linear`` and ``q8_linear``."""

    isa: str
    path: Path

    @property
    def q8_unsigned(self) -> bool:
        """Whether ``q8_linear`` wants the weights as ``w + 128`` (uint8; the VNNI kernel) rather
        than as their own int8 bytes."""
        return self.isa == "avx512vnni"


def kernel_cache_dir() -> Path:
    """``$KVREUSE_KERNEL_CACHE`` or ``~/.cache/kvreuse/kernels``."""
    env = os.environ.get("KVREUSE_KERNEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvreuse" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compile_command(compiler: str, sources: tuple[Path, ...], out: Path) -> list[str]:
    from torch.utils import cpp_extension  # only when a build is needed

    torch_lib = str(Path(torch.__file__).parent / "lib")
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        compiler,
        *FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *includes,
        *(str(s) for s in sources),
        f"-L{torch_lib}",
        f"-Wl,-rpath,{torch_lib}",
        *("-lc10", "-ltorch_cpu", "-ltorch"),
        "-o",
        str(out),
    ]


def build_library(cache: Path | None = None) -> Path:
    """Compile ``SOURCES`` (``gemv.cpp``, ``attention.cpp``, ``layers.cpp``) for this CPU and
    torch into ``cache`` (default :func:`kernel_cache_dir`) unless a build with the same key is
    there; returns the ``.so``.

    Raises RuntimeError (no compiler, or the compiler's own error text) on failure. Safe to race:
    each build writes a temporary file and renames it into place."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.split("\n", 1)[0]
    text = b"\0".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    flags = " ".join(FLAGS)  # the flags change the bits too
    key = hashlib.sha256(b"\0".join(s.encode() for s in (torch.__version__, version, _cpu_flags(), flags)) + text)
    cache = cache or kernel_cache_dir()
    out = cache / f"kvreuse_gemv_{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=".build.", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run(_compile_command(compiler, SOURCES, Path(tmp)), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _loaded_library() -> Path | None:
    """The kernels' ``.so`` this process has loaded already, if any: a process registers the
    ``kvreuse`` ops once, and loading a second build (another cache dir, an edited source) would
    abort it (``Only a single TORCH_LIBRARY can be used to register the namespace kvreuse``)."""
    for loaded in torch.ops.loaded_libraries:
        if Path(loaded).name.startswith("kvreuse_gemv_"):
            return Path(loaded)
    return None


@lru_cache(maxsize=1)
def native_kernels() -> NativeKernels | None:
    """The kernels for this process (built or loaded once), or None where they are off, cannot
    be built, or would not beat PyTorch's (no AVX2). Logs the outcome once."""
    if os.environ.get(ENV_SWITCH, "").strip().lower() in ("off", "0", "false", "no"):
        log.info("native kernels off (%s)", ENV_SWITCH)
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        log.info("native kernels: not built on %s (x86-64 only)", platform.machine())
        return None
    try:
        path = build_library()
        path = _loaded_library() or path  # never a second build into one process
        torch.ops.load_library(str(path))  # a no-op for the library already loaded
        isa = str(torch.ops.kvreuse.isa())
    except (RuntimeError, OSError) as exc:
        log.warning("native kernels unavailable, using PyTorch's: %s", exc)
        return None
    if isa not in FAST_ISAS:
        log.info("native kernels: this CPU has no AVX2, using PyTorch's")
        return None
    log.info("native kernels: %s (%s)", isa, path)
    return NativeKernels(isa=isa, path=path)
