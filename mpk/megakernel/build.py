"""nvcc build of generated CUDA, cached by content hash.

The cache key covers the generated source, every header under ``runtime/`` and ``cuda/``, the
flags, the target architecture and nvcc's version, so a second identical build reads the
cubin from ``$MPK_CACHE_DIR`` (default ``~/.cache/mpk``) without invoking nvcc.
``$MPK_NVCC_FLAGS`` (whitespace-separated) adds flags to every build, e.g. the ``-D`` switches
of the CUDA headers for an experiment (``-DMPK_MAX_SPINS=…``); they are part of the key.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path

from mpk.errors import MpkError

ROOT = Path(__file__).resolve().parents[2]
INCLUDE_DIRS = (ROOT / "runtime", ROOT / "cuda")


class BuildError(MpkError):
    """nvcc rejected generated code; the message holds the file's path and nvcc's output."""


def cache_dir() -> Path:
    return Path(os.environ.get("MPK_CACHE_DIR") or Path.home() / ".cache" / "mpk")


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


@lru_cache(maxsize=1)
def nvcc_version() -> str:
    nvcc = nvcc_path()
    if nvcc is None:
        raise BuildError("nvcc was not found on PATH; install the CUDA toolkit (nvcc ≥ 12.4 for sm_90a)")
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]


def _headers_digest() -> str:
    h = hashlib.sha256()
    for d in INCLUDE_DIRS:
        for p in sorted(d.rglob("*.cuh")):
            h.update(str(p.relative_to(ROOT)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def arch_flags(arch: str) -> list[str]:
    """'sm_90a' → the -gencode form (the -arch shorthand also runs a plain sm_90 pass)."""
    num = arch.removeprefix("sm_")
    return [f"-gencode=arch=compute_{num},code=sm_{num}"]


# environment variables nvcc reads flags from (part of a build's cache key)
NVCC_ENV_FLAGS = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")


def nvcc_flags(arch: str = "sm_90a", debug: bool = False, tile_kernel: bool = False) -> list[str]:
    """nvcc's flags for a generated source (without the include dirs, ``INCLUDE_DIRS``)."""
    flags = ["-std=c++17", "-O3", "-cubin", "-lineinfo", *arch_flags(arch)]
    flags += ["-DMPK_DEBUG"] if debug else []
    flags += ["-DMPK_TILE_KERNEL"] if tile_kernel else []
    return flags + os.environ.get("MPK_NVCC_FLAGS", "").split()


def build_cubin(source: str, arch: str = "sm_90a", debug: bool = False, tile_kernel: bool = False,
                progress: bool | None = None) -> Path:
    """Compile ``source`` to a cubin for ``arch``; returns the cached cubin's path.
    ``tile_kernel``: also build the test wrapper ``mpk_tile_kernel``. ``progress``: say on
    stderr when nvcc runs and how long it took (a full-size decode step takes ~10 s;
    default: when stderr is a terminal)."""
    flags = nvcc_flags(arch, debug, tile_kernel)
    # nvcc also takes flags from these variables: they are part of what was built
    env_flags = [os.environ.get(v, "") for v in NVCC_ENV_FLAGS]
    key = hashlib.sha256("\0".join([source, _headers_digest(), " ".join(flags), *env_flags, nvcc_version()])
                         .encode()).hexdigest()[:32]
    out_dir = cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    cubin = out_dir / f"{key}.cubin"
    if cubin.exists():
        return cubin
    # names of this build alone: concurrent builders of one key (processes or threads) never
    # share a file
    fd, name = tempfile.mkstemp(prefix=f"{key}.", suffix=".cu", dir=out_dir)
    with os.fdopen(fd, "w") as f:
        f.write(source)
    src, tmp = Path(name), Path(name).with_suffix(".tmp")
    includes = [f"-I{d}" for d in INCLUDE_DIRS]
    say = sys.stderr.isatty() if progress is None else progress
    if say:
        print(f"mpk: nvcc is building the megakernel for {arch} (once; cached as {cubin}) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    res = subprocess.run([nvcc_path() or "nvcc", *flags, *includes, "-o", str(tmp), str(src)],
                         capture_output=True, text=True)
    if say:
        print(f"mpk: nvcc {'finished' if res.returncode == 0 else 'failed'} in {time.perf_counter() - start:.1f} s",
              file=sys.stderr, flush=True)
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"nvcc failed (exit {res.returncode}) building {src}:\n{res.stderr.strip()[-6000:]}")
    tmp.replace(cubin)  # atomic: concurrent builders of one key never see a partial cubin
    src.replace(out_dir / f"{key}.cu")  # kept beside the cubin for reading
    return cubin


def prebuild(sources: list[str], arch: str = "sm_90a", jobs: int | None = None,
             progress: bool | None = None) -> list[Path]:
    """Build several generated sources at once (nvcc runs in parallel processes), so later
    ``GpuExecutor``s find their cubins in the cache; a progress bar on stderr counts the builds
    (``progress``: default when stderr is a terminal)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from tqdm import tqdm

    unique = list(dict.fromkeys(sources))  # one build per source
    with ThreadPoolExecutor(max_workers=jobs or min(len(unique), os.cpu_count() or 1) or 1) as pool, \
            tqdm(total=len(unique), desc="nvcc", unit="cubin", disable=None if progress is None else not progress) as bar:
        futures = {pool.submit(build_cubin, s, arch, progress=False): s for s in unique}
        built = {}
        for done in as_completed(futures):
            built[futures[done]] = done.result()
            bar.update()
    return [built[s] for s in sources]
