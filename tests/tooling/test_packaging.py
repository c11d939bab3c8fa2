"""The wheel is a working package: built from the checkout (sdist, then the wheel from the
sdist, as ``python -m build`` does) and installed into a fresh virtual environment, mpk imports
from there, finds the CUDA headers it ships (``mpk/_cuda/``) and nvcc-builds a compiled model's
kernel with them; the headers' digest, and so the cubin cache key, is the checkout's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from mpk.executors import build

ROOT = Path(__file__).resolve().parents[2]

# run inside the venv, from a directory outside the checkout; argv: the file for the results
SCRIPT = textwrap.dedent("""
    import json, sys
    from importlib.metadata import entry_points
    from pathlib import Path

    import torch

    import mpk
    from mpk.executors import build
    from mpk.executors.codegen import generate
    from mpk.inspection import compile_module

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    tables = compile_module(model, (torch.randn(2, 16),), {"num_workers": 4}).tables
    source = generate(tables)
    cubin = build.build_cubin(source, progress=False) if build.nvcc_path() else None
    Path(sys.argv[1]).write_text(json.dumps({
        "mpk": mpk.__file__,
        "include_dirs": [str(d) for d in build.include_dirs()],
        "digest": build._headers_digest(),
        "backends": {e.name: e.value for e in entry_points(group="torch_dynamo_backends")},
        "source": source,
        "cubin": str(cubin) if cubin else None,
    }))
""")


def _run(cmd, **kw):
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)
    assert res.returncode == 0, f"{' '.join(map(str, cmd))} failed ({res.returncode}):\n{res.stdout[-3000:]}\n" \
                                f"{res.stderr[-3000:]}"
    return res


@pytest.mark.slow
def test_wheel_installs_and_builds_a_kernel_outside_the_checkout(tmp_path, monkeypatch):
    pytest.importorskip("build", reason="needs the 'build' package (pip install -e '.[test]')")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["MPK_CACHE_DIR"] = str(tmp_path / "cache")

    # sdist, then the wheel from the unpacked sdist: also checks the sdist carries runtime/ and cuda/
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)], env=env)
    (wheel,) = dist.glob("mpk-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    headers = sorted(n.removeprefix("mpk/_cuda/") for n in names if n.startswith("mpk/_cuda/"))
    checkout = sorted(str(p.relative_to(ROOT)) for d in ("runtime", "cuda") for p in (ROOT / d).rglob("*.cuh"))
    assert headers == checkout and "mpk/executors/build.py" in names
    assert not [n for n in names if n.startswith(("tests/", "runtime/", "cuda/")) or "__pycache__" in n]

    # a fresh venv that reuses the system's torch; the system's pip installs into it
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], env=env)
    python = venv / "bin" / "python"
    if subprocess.run([python, "-m", "pip", "--version"], capture_output=True, env=env).returncode != 0:
        _run([python, "-m", "ensurepip", "--default-pip"], env=env)  # the system's pip is not importable there
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
          "--disable-pip-version-check", "--quiet", str(wheel)], env=env)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "check.py").write_text(SCRIPT)
    _run([python, "check.py", str(tmp_path / "result.json")], cwd=elsewhere, env=env)
    got = json.loads((tmp_path / "result.json").read_text())

    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], env=env).stdout.strip())
    package = site / "mpk"
    assert Path(got["mpk"]) == package / "__init__.py", f"imported {got['mpk']}, not the installed wheel"
    assert got["include_dirs"] == [str(package / "_cuda" / "runtime"), str(package / "_cuda" / "cuda")]
    assert got["digest"] == build._headers_digest(), "the installed headers hash differently from the checkout's"
    assert got["backends"].get("mpk") == "mpk.backend:mpk_backend"
    assert (venv / "bin" / "mpk").exists()

    if got["cubin"] is None:
        pytest.skip("nvcc is not on PATH: the wheel was built, installed and imported, its kernel was not built")
    cubin = Path(got["cubin"])
    assert cubin.parent == tmp_path / "cache" and cubin.read_bytes()[:4] == b"\x7fELF"
    # the checkout's mpk, given no compiler, finds that cubin of the same source: the same cache key
    monkeypatch.setenv("MPK_CACHE_DIR", env["MPK_CACHE_DIR"])
    monkeypatch.setattr(build, "nvcc_path", lambda: None)
    assert build.build_cubin(got["source"]) == cubin
