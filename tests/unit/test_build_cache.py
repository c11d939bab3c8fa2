"""The cubin cache's defences (mpk/executors/build.py), with a fake nvcc so no test compiles:
a cubin needs its digest, the lock is not followed through a symlink, a cache others can write
is refused, stale temporaries go, and nvcc's whole process group dies on a timeout or an
interrupt."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpk.executors import build

# writes an ELF header that passes _whole_elf and 200 random bytes; with MPK_FAKE_CHILD set it
# first starts a `sleep` child, writes its pid there and sleeps (an nvcc whose cicc hangs)
FAKE_NVCC = f"""#!{sys.executable}
import os, subprocess, sys, time
child = os.environ.get("MPK_FAKE_CHILD")
if child:
    p = subprocess.Popen(["sleep", "60"])
    open(child + ".part", "w").write(str(p.pid))
    os.replace(child + ".part", child)
    time.sleep(60)
out = sys.argv[sys.argv.index("-o") + 1]
head = bytearray(64); head[:5] = b"\\x7fELF\\x02"
open(out, "wb").write(bytes(head) + os.urandom(200))
open(os.environ["MPK_FAKE_LOG"], "a").write("built\\n")
"""


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
    """A fake nvcc on PATH and a fresh cache; returns the log of its builds."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvcc").write_text(FAKE_NVCC)
    (bin_dir / "nvcc").chmod(0o755)
    log = tmp_path / "builds.log"
    log.write_text("")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("MPK_FAKE_LOG", str(log))
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MPK_NVCC_TIMEOUT_S", raising=False)
    monkeypatch.setattr(build, "nvcc_version", lambda: "fake nvcc")
    assert build.nvcc_path() == str(bin_dir / "nvcc")
    return log


def builds(log: Path) -> int:
    return log.read_text().count("built")


def gone(pid: int, within_s: float = 5.0) -> bool:
    """The process has exited (a zombie no one reaped counts as gone)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_a_cubin_without_a_valid_digest_is_rebuilt(fake_nvcc):
    """A cached cubin is taken only with its digest: one without (a legacy entry), or with a
    digest that is not one, is rebuilt; an intact one is not."""
    cubin = build.build_cubin("// a\n", progress=False)
    assert builds(fake_nvcc) == 1 and build._intact(cubin)
    assert build.build_cubin("// a\n", progress=False) == cubin and builds(fake_nvcc) == 1
    digest = cubin.with_suffix(".sha256")
    digest.unlink()
    assert build._whole_elf(cubin) and not build._intact(cubin)
    assert build.build_cubin("// a\n", progress=False) == cubin and builds(fake_nvcc) == 2 and build._intact(cubin)
    digest.write_text("not a digest\n")
    assert build.build_cubin("// a\n", progress=False) == cubin and builds(fake_nvcc) == 3 and build._intact(cubin)
    digest.write_bytes(b"\xff\xfe binary")
    assert not build._intact(cubin)


def test_without_nvcc_a_cubin_without_digest_is_not_served(fake_nvcc, monkeypatch):
    cubin = build.build_cubin("// b\n", progress=False)
    cubin.with_suffix(".sha256").unlink()
    monkeypatch.setattr(build, "nvcc_path", lambda: None)
    with pytest.raises(build.BuildError, match="holds no cubin of this source"):
        build.build_cubin("// b\n")


def test_a_symlink_at_the_lock_path_is_refused(fake_nvcc, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    target = tmp_path / "elsewhere"
    (cache / ".lock").symlink_to(target)
    with pytest.raises(build.BuildError, match=r"lock file .*\.lock cannot be opened \(a symbolic link, refused\)"):
        build.build_cubin("// c\n", progress=False)
    assert not target.exists()


@pytest.mark.parametrize("where", ["lock", "cubin", "digest"])
def test_a_directory_where_a_cache_file_goes_is_a_build_error(fake_nvcc, tmp_path, where):
    cubin = build.build_cubin("// d\n", progress=False)
    cubin.unlink()
    cubin.with_suffix(".sha256").unlink()
    path = {"lock": tmp_path / "cache" / ".lock", "cubin": cubin, "digest": cubin.with_suffix(".sha256")}[where]
    path.unlink(missing_ok=True)
    path.mkdir()
    with pytest.raises(build.BuildError) as info:
        build.build_cubin("// d\n", progress=False)
    assert str(path) in str(info.value) and ("directory" in str(info.value) or "Is a directory" in str(info.value))


def test_a_cache_others_can_write_is_refused(fake_nvcc, tmp_path):
    """A group- or world-writable cache without the sticky bit, or one another user owns, is
    refused with how to fix it; the sticky bit (as /tmp has) makes it acceptable."""
    cache = tmp_path / "cache"
    cache.mkdir()
    for mode in (0o777, 0o775):
        cache.chmod(mode)
        with pytest.raises(build.BuildError, match=rf"{cache} is writable by others \(mode {mode:#o}\).*chmod go-w"):
            build.build_cubin("// e\n", progress=False)
    cache.chmod(0o1777)
    build.build_cubin("// e\n", progress=False)
    cache.chmod(0o755)
    if os.geteuid() == 0:  # (only root can give a directory away)
        os.chown(cache, 4321, -1)
        with pytest.raises(build.BuildError, match=r"is owned by uid 4321, not by you"):
            build.build_cubin("// e\n", progress=False)
        os.chown(cache, 0, -1)


def test_a_new_cache_directory_is_not_group_writable(fake_nvcc, tmp_path):
    old = os.umask(0o002)
    try:
        build.build_cubin("// f\n", progress=False)
    finally:
        os.umask(old)
    assert (tmp_path / "cache").stat().st_mode & 0o022 == 0


def test_stale_temporaries_are_removed_by_the_next_build(fake_nvcc, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    stale, digest, fresh = cache / "k-1.abc.tmp", cache / "k-1.abc.tmp.sha256", cache / "k-2.def.tmp"
    for p in (stale, digest, fresh):
        p.write_bytes(b"half a cubin")
    old = time.time() - build.STALE_TMP_S - 60
    for p in (stale, digest):
        os.utime(p, (old, old))
    build.build_cubin("// g\n", progress=False)
    assert not stale.exists() and not digest.exists() and fresh.exists()


def test_an_nvcc_past_its_timeout_is_killed_with_its_children(fake_nvcc, tmp_path, monkeypatch):
    child = tmp_path / "child.pid"
    monkeypatch.setenv("MPK_FAKE_CHILD", str(child))
    monkeypatch.setenv("MPK_NVCC_TIMEOUT_S", "1.5")
    start = time.monotonic()
    with pytest.raises(build.BuildError, match=r"nvcc did not finish building .*\.cu within 1\.5 s"):
        build.build_cubin("// h\n", progress=False)
    assert time.monotonic() - start < 30
    assert gone(int(child.read_text()))
    assert not list((tmp_path / "cache").glob("*.tmp"))


@pytest.mark.parametrize("bad", ["soon", "0", "-1", "inf", "nan", "1e9"])
def test_a_bad_nvcc_timeout_is_named(fake_nvcc, monkeypatch, bad):
    monkeypatch.setenv("MPK_NVCC_TIMEOUT_S", bad)
    with pytest.raises(build.BuildError, match=r"\$MPK_NVCC_TIMEOUT_S=.*expected a number of seconds"):
        build.build_cubin("// i\n", progress=False)
    monkeypatch.delenv("MPK_NVCC_TIMEOUT_S")
    with pytest.raises(build.BuildError, match=r"timeout_s=True"):
        build.build_cubin("// i\n", progress=False, timeout_s=True)


def test_an_interrupt_kills_nvccs_process_group(fake_nvcc, tmp_path, monkeypatch):
    """KeyboardInterrupt while waiting for nvcc kills its group (the child too) and propagates."""
    child = tmp_path / "child.pid"
    monkeypatch.setenv("MPK_FAKE_CHILD", str(child))
    real = subprocess.Popen.communicate
    started: list[int] = []

    def interrupted(self, *a, **k):
        if not started:
            started.append(self.pid)
            deadline = time.monotonic() + 20
            while not child.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(subprocess.Popen, "communicate", interrupted)
    killed = []
    real_killpg = os.killpg
    monkeypatch.setattr(build.os, "killpg", lambda pgid, sig: (killed.append(pgid), real_killpg(pgid, sig)))
    with pytest.raises(KeyboardInterrupt):
        build.run_nvcc([build.nvcc_path(), "-o", str(tmp_path / "x.tmp"), "x.cu"], Path("x.cu"), 60)
    assert killed == started
    assert gone(started[0]) and gone(int(child.read_text()))
