"""setuptools glue for what pyproject.toml cannot say: the CUDA sources stay at the top level of
the repository (``runtime/``, ``cuda/``) and ship inside the package as ``mpk/_cuda/runtime``
and ``mpk/_cuda/cuda``, where ``mpk.executors.build.include_dirs`` finds them in an installed
package. MANIFEST.in puts the two folders into the sdist, so a wheel built from it has them too.
An editable install copies nothing: it runs from the checkout and reads the top-level folders.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
CUDA_FOLDERS = ("runtime", "cuda")
PACKAGE_CUDA = Path("mpk", "_cuda")


def cuda_files() -> list[Path]:
    """The files of the CUDA folders, relative to the project root."""
    found = []
    for name in CUDA_FOLDERS:
        folder = HERE / name
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} is missing: mpk's CUDA sources are part of the package")
        found += [p.relative_to(HERE) for p in sorted(folder.rglob("*"))
                  if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith(".")]
    return found


class BuildPyWithCuda(build_py):
    """build_py that also copies runtime/ and cuda/ into the built package (mpk/_cuda/)."""

    def _cuda_outputs(self) -> list[tuple[Path, Path]]:
        if getattr(self, "editable_mode", False):
            return []
        return [(HERE / f, Path(self.build_lib) / PACKAGE_CUDA / f) for f in cuda_files()]

    def run(self):
        super().run()
        for src, dest in self._cuda_outputs():
            self.mkpath(str(dest.parent))
            self.copy_file(str(src), str(dest), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [str(dest) for _, dest in self._cuda_outputs()]


setup(cmdclass={"build_py": BuildPyWithCuda})
