"""nvcc build of generated CUDA, cached by content hash.

The generated source includes the CUDA headers of ``runtime/`` (``mpk_runtime/*.cuh``, the
persistent kernel) and ``cuda/`` (``mpk_tasks/*.cuh``, the task library), found by
``include_dirs``: an installed package carries them as package data under ``mpk/_cuda/``, a
source checkout (an editable install, or running from the repository) at its top level.

A cubin is cached in ``$MPK_CACHE_DIR`` (default ``~/.cache/mpk``) as ``<source key>-<nvcc
key>.cubin``: the first covers the generated source, every ``.cuh`` header of the two folders
(by its path inside them, not where they were found, so a wheel install and a checkout of the
same sources share cubins), the flags and the target architecture, the second nvcc's version, so a second
identical build reads the cubin without compiling, and a machine without nvcc (a driver-only
deployment given a prebuilt cache) takes a cubin of the same source built by any nvcc. Beside each
cubin its SHA-256 (``.sha256``); a cached file that is not a whole ELF image, has no valid digest
beside it, or whose bytes differ from that digest (an interrupted or damaged copy of the cache) is
rebuilt, not loaded. The cache directory must be the user's (or root's) and not writable by others
unless sticky, since whoever can write it chooses the code the GPU runs. nvcc runs in a process group
of its own, killed whole (ptxas and cicc with it) on a timeout (``$MPK_NVCC_TIMEOUT_S``, default
600 s) or an interrupt; temporaries an hour old (a build killed midway) are removed by the next build.
``$MPK_NVCC_FLAGS`` (whitespace-separated) adds flags to every build, e.g. the ``-D`` switches
of the CUDA headers for an experiment (``-DMPK_MAX_SPINS=…``); they are part of the key.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path

from mpk.errors import MpkError

# the mpk package's folder; the CUDA header folders nvcc's -I takes, by name
PACKAGE_DIR = Path(__file__).resolve().parents[1]
HEADER_FOLDERS = ("runtime", "cuda")


class BuildError(MpkError):
    """nvcc rejected generated code; the message holds the file's path and nvcc's output."""


def include_dirs() -> tuple[Path, ...]:
    """The header folders (``runtime/``, ``cuda/``) the generated source is compiled against:
    the package data of an installed package (``mpk/_cuda/runtime``, ``mpk/_cuda/cuda``) when
    present, else the top-level folders of the source checkout the package runs from."""
    candidates = (PACKAGE_DIR / "_cuda", PACKAGE_DIR.parent)
    for base in candidates:
        dirs = tuple(base / name for name in HEADER_FOLDERS)
        if all(any(d.rglob("*.cuh")) for d in dirs):
            return dirs
    raise BuildError("mpk's CUDA headers are missing: looked for runtime/ and cuda/ under "
                     f"{' and '.join(str(b) for b in candidates)} (reinstall mpk, or run it from a full checkout)")


def cache_dir() -> Path:
    return Path(os.environ.get("MPK_CACHE_DIR") or Path.home() / ".cache" / "mpk")


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


_NO_NVCC = "nvcc was not found on PATH; install the CUDA toolkit (nvcc ≥ 12.4 for sm_90a)"


@lru_cache(maxsize=1)
def nvcc_version() -> str:
    nvcc = nvcc_path()
    if nvcc is None:
        raise BuildError(_NO_NVCC)
    res = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
    lines = res.stdout.strip().splitlines()
    if res.returncode != 0 or not lines:
        raise BuildError(f"{nvcc} --version failed (exit {res.returncode}): {(res.stderr or res.stdout).strip()[-2000:]}")
    return lines[-1]


def _whole_elf(path: Path) -> bool:
    """The file is a 64-bit ELF image whose section table lies inside it (a cut copy is not)."""
    try:
        with path.open("rb") as f:
            head, size = f.read(64), os.fstat(f.fileno()).st_size
    except OSError:
        return False
    if len(head) < 64 or head[:5] != b"\x7fELF\x02":
        return False
    shoff = int.from_bytes(head[0x28:0x30], "little")
    shentsize, shnum = int.from_bytes(head[0x3A:0x3C], "little"), int.from_bytes(head[0x3C:0x3E], "little")
    return shoff + shentsize * shnum <= size


def _intact(cubin: Path) -> bool:
    """A whole ELF image whose bytes match the 64-hex-digit digest written beside it when it was
    built (a cubin without one, as an older mpk left them, is rebuilt: nothing vouches for it)."""
    if not _whole_elf(cubin):
        return False
    try:
        want = cubin.with_suffix(".sha256").read_text().strip()
        got = hashlib.sha256(cubin.read_bytes()).hexdigest()
    except (OSError, UnicodeDecodeError):
        return False
    return len(want) == 64 and got == want


def _cache_error(out_dir: Path, e: OSError) -> BuildError:
    return BuildError(f"the cubin cache {out_dir} ($MPK_CACHE_DIR, default ~/.cache/mpk) is not a writable "
                      f"directory: {e}")


def _check_cache_dir(out_dir: Path) -> None:
    """BuildError unless ``out_dir`` (when it exists) is a directory owned by this user (or root)
    that others cannot write, or can only add to (the sticky bit): a cubin from the cache runs
    on the GPU unchecked, so whoever can replace one chooses the code."""
    try:
        st = out_dir.stat()
    except FileNotFoundError:
        return
    except OSError as e:
        raise _cache_error(out_dir, e) from None
    if not stat.S_ISDIR(st.st_mode):
        raise BuildError(f"the cubin cache {out_dir} ($MPK_CACHE_DIR, default ~/.cache/mpk) is not a writable "
                         "directory: it is a file; expected a directory (made if absent)")
    if st.st_uid not in (os.geteuid(), 0):
        raise BuildError(f"the cubin cache {out_dir} is owned by uid {st.st_uid}, not by you (uid {os.geteuid()}): "
                         "its owner could replace the cubins mpk loads; expected a directory of your own (set "
                         "$MPK_CACHE_DIR to one, or chown it)")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise BuildError(f"the cubin cache {out_dir} is writable by others (mode {stat.S_IMODE(st.st_mode):#o}): any "
                         f"of them could replace the cubins mpk loads; expected it writable by you alone (run "
                         f"`chmod go-w {out_dir}`)")


def _not_a_file(path: Path) -> BuildError | None:
    """A BuildError naming ``path`` if something other than a plain file (a directory, say) is
    there, which no build could replace."""
    if path.is_symlink() or (path.exists() and not path.is_file()):
        kind = "symbolic link" if path.is_symlink() else "directory" if path.is_dir() else "special file"
        return BuildError(f"{path} in the cubin cache is a {kind}; expected a plain file (remove it)")
    return None


def _open_lock(out_dir: Path) -> int:
    """The cache's lock file, opened without following a symbolic link (one planted there would
    make this build create or append to the file it points at)."""
    lock = out_dir / ".lock"
    try:
        return os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        why = "a symbolic link, refused" if e.errno == errno.ELOOP else e.strerror
        raise BuildError(f"the cubin cache's lock file {lock} cannot be opened ({why}); expected a plain file "
                         "(remove it)") from None


STALE_TMP_S = 3600  # a temporary this old is no live build's (nvcc_timeout() is at most this, see there)


def _remove_stale_temporaries(out_dir: Path, keep: Path) -> None:
    """Remove ``*.tmp`` cubins and their digests that builds killed midway (SIGKILL) left behind;
    called under the lock."""
    now = time.time()
    for p in (*out_dir.glob("*.tmp"), *out_dir.glob("*.tmp.sha256")):
        try:
            if p != keep and p.is_file() and not p.is_symlink() and now - p.stat().st_mtime > STALE_TMP_S:
                p.unlink()
        except OSError:
            pass  # another builder removed it first


DEFAULT_NVCC_TIMEOUT_S = 600.0


def nvcc_timeout(timeout_s: float | None = None) -> float:
    """Seconds one nvcc run may take: ``timeout_s``, else ``$MPK_NVCC_TIMEOUT_S``, else 600
    (a full-size decode step builds in ~10 s); at most ``STALE_TMP_S``, so a live build's
    temporary is never taken for a stale one."""
    where = "timeout_s"
    if timeout_s is None and os.environ.get("MPK_NVCC_TIMEOUT_S", "").strip():
        where, raw = "$MPK_NVCC_TIMEOUT_S", os.environ["MPK_NVCC_TIMEOUT_S"].strip()
        try:
            timeout_s = float(raw)
        except ValueError:
            timeout_s = raw  # type: ignore[assignment]
    t = DEFAULT_NVCC_TIMEOUT_S if timeout_s is None else timeout_s
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= STALE_TMP_S:
        raise BuildError(f"{where}={t!r}; expected a number of seconds in (0, {STALE_TMP_S}]")
    return float(t)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill nvcc's whole process group (cicc, ptxas: they would otherwise compile on) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.communicate(timeout=10)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        pass


def run_nvcc(cmd: list[str], src: Path, timeout_s: float) -> subprocess.CompletedProcess:
    """Run nvcc in a process group of its own (a terminal's Ctrl-C reaches this process, which
    then ends the group, not a half-dead build); on a timeout or an interrupt the whole group is
    killed before the BuildError / KeyboardInterrupt propagates."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise BuildError(f"nvcc did not finish building {src} within {timeout_s:g} s (its process group was "
                         "killed); expected a build within the limit: raise $MPK_NVCC_TIMEOUT_S") from None
    except BaseException:
        _kill_group(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _headers_digest(dirs: tuple[Path, ...] | None = None) -> str:
    """SHA-256 over the headers' paths (``runtime/mpk_runtime/sync.cuh``: relative to the folders'
    parent, the same for the package data and a checkout) and bytes."""
    h = hashlib.sha256()
    for d in dirs or include_dirs():
        for p in sorted(d.rglob("*.cuh")):
            h.update(f"{d.name}/{p.relative_to(d).as_posix()}".encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def arch_flags(arch: str) -> list[str]:
    """'sm_90a' → the -gencode form (the -arch shorthand also runs a plain sm_90 pass)."""
    num = arch.removeprefix("sm_")
    return [f"-gencode=arch=compute_{num},code=sm_{num}"]


# environment variables nvcc reads flags from (part of a build's cache key)
NVCC_ENV_FLAGS = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")


def nvcc_flags(arch: str = "sm_90a", debug: bool = False, tile_kernel: bool = False) -> list[str]:
    """nvcc's flags for a generated source (without the include dirs, ``include_dirs()``)."""
    flags = ["-std=c++17", "-O3", "-cubin", "-lineinfo", *arch_flags(arch)]
    flags += ["-DMPK_DEBUG"] if debug else []
    flags += ["-DMPK_TILE_KERNEL"] if tile_kernel else []
    return flags + os.environ.get("MPK_NVCC_FLAGS", "").split()


def build_cubin(source: str, arch: str = "sm_90a", debug: bool = False, tile_kernel: bool = False,
                progress: bool | None = None, timeout_s: float | None = None) -> Path:
    """Compile ``source`` to a cubin for ``arch``; returns the cached cubin's path.
    ``tile_kernel``: also build the test wrapper ``mpk_tile_kernel``. ``progress``: say on
    stderr when nvcc runs and how long it took (a full-size decode step takes ~10 s;
    default: when stderr is a terminal). ``timeout_s``: nvcc's limit (``nvcc_timeout``)."""
    timeout = nvcc_timeout(timeout_s)
    flags = nvcc_flags(arch, debug, tile_kernel)
    # nvcc also takes flags from these variables: they are part of what was built
    env_flags = [os.environ.get(v, "") for v in NVCC_ENV_FLAGS]
    headers = include_dirs()
    key = hashlib.sha256("\0".join([source, _headers_digest(headers), " ".join(flags), *env_flags]).encode()).hexdigest()[:32]
    out_dir = cache_dir()
    _check_cache_dir(out_dir)
    if nvcc_path() is None:  # no compiler: a cubin of this source from any nvcc, newest first
        found = sorted(out_dir.glob(f"{key}-*.cubin"), key=lambda p: p.stat().st_mtime, reverse=True)
        for cubin in found:
            if _intact(cubin):
                return cubin
        raise BuildError(_NO_NVCC + f" (and {out_dir} holds no cubin of this source)")
    cubin = out_dir / f"{key}-{hashlib.sha256(nvcc_version().encode()).hexdigest()[:8]}.cubin"
    if _intact(cubin):
        return cubin
    for path in (cubin, cubin.with_suffix(".sha256"), cubin.with_suffix(".cu")):
        if (bad := _not_a_file(path)) is not None:
            raise bad
    say = sys.stderr.isatty() if progress is None else progress
    if say and cubin.exists():
        print(f"mpk: {cubin} is damaged (cut short, or not the bytes that were built); rebuilding it",
              file=sys.stderr, flush=True)
    try:
        out_dir.mkdir(parents=True, exist_ok=True, mode=0o755)  # never group-writable, whatever the umask
        # the source under its final name (the cubin's line info names it; identical content
        # whoever writes it), the cubin under a name of this build alone, renamed when whole:
        # concurrent builders of one key never see a partial file
        fd, name = tempfile.mkstemp(prefix=f"{cubin.stem}.", suffix=".cu", dir=out_dir)
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.chmod(name, 0o644)
        src = cubin.with_suffix(".cu")
        Path(name).replace(src)
        fd, tmp_name = tempfile.mkstemp(prefix=f"{cubin.stem}.", suffix=".tmp", dir=out_dir)
        os.close(fd)
    except OSError as e:
        raise _cache_error(out_dir, e) from None
    tmp = Path(tmp_name)
    tmp_digest = Path(f"{tmp}.sha256")
    includes = [f"-I{d}" for d in headers]
    if say:
        print(f"mpk: nvcc is building the megakernel for {arch} (once; cached as {cubin}) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    cmd = [nvcc_path() or "nvcc", *flags, *includes, "-o", str(tmp), str(src)]
    try:
        res = run_nvcc(cmd, src, timeout)
        if say:
            print(f"mpk: nvcc {'finished' if res.returncode == 0 else 'failed'} in {time.perf_counter() - start:.1f} s",
                  file=sys.stderr, flush=True)
        if res.returncode == -signal.SIGINT:  # someone interrupted nvcc itself: the user's interrupt, not a build error
            raise KeyboardInterrupt
        if res.returncode < 0:
            raise BuildError(f"nvcc was killed by {signal.Signals(-res.returncode).name} building {src} (out of "
                             f"memory? each full-size decode step needs a few GB; prebuild with fewer --jobs)")
        if res.returncode != 0:
            extra = os.environ.get("MPK_NVCC_FLAGS", "").strip()
            raise BuildError(f"nvcc failed (exit {res.returncode}) building {src}:\n{res.stderr.strip()[-6000:]}\n"
                             f"command: {' '.join(cmd)}" + (f"\n(with $MPK_NVCC_FLAGS={extra!r})" if extra else ""))
        tmp_digest.write_text(hashlib.sha256(tmp.read_bytes()).hexdigest() + "\n")
        for f in (tmp, tmp_digest):
            os.chmod(f, 0o644)
        # nvcc's bytes differ from run to run: of concurrent builders of one key the first to
        # finish keeps its cubin and digest, the others drop theirs (the pair never mixes)
        lock = _open_lock(out_dir)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _remove_stale_temporaries(out_dir, tmp)
            if not _intact(cubin):
                try:
                    tmp_digest.replace(cubin.with_suffix(".sha256"))
                    tmp.replace(cubin)
                except OSError as e:
                    raise BuildError(f"cannot put the built cubin at {e.filename or cubin} ({e.strerror}); expected "
                                     "a plain file or nothing there") from None
        finally:
            os.close(lock)
    finally:
        tmp.unlink(missing_ok=True)
        tmp_digest.unlink(missing_ok=True)
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
