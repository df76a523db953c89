"""Build the extension (``_ext``) with CMake into this package's folder, when its inputs changed.

The inputs are the sources, mlx's version and the Python version (a module built against one
mlx must not be loaded with another); their digest is kept next to the module with the
nanobind version it was built with, so running this again with nothing changed costs a hash of
~40 KB. A different nanobind installed since rebuilds too; none installed (it is only a build
dependency) leaves a built module alone.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import attrs

__all__ = ["BuildResult", "build"]

HERE = Path(__file__).resolve().parent
_STAMP = HERE / ".build-stamp"
_BUILD_DIR = HERE / "build"
# The tools this machine's image provides; any cmake >= 3.24 and g++ >= 11 would do.
_CMAKE = "/usr/bin/cmake"
_CXX = "/usr/bin/g++"


@attrs.frozen
class BuildResult:
    """``built``: compiled now; ``ok``: the module is there and current; ``message``: one line."""

    ok: bool
    built: bool
    message: str


def _module_path() -> Path | None:
    found = sorted(HERE.glob("_ext.*.so"))
    return found[0] if found else None


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _digest() -> str:
    h = hashlib.sha256()
    for path in sorted([HERE / "CMakeLists.txt", *(HERE / "src").iterdir()]):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    for part in (_version("mlx"), sys.version):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def _tool(path: str) -> str | None:
    return path if Path(path).is_file() else shutil.which(Path(path).name)


def build(*, force: bool = False, jobs: int = 2) -> BuildResult:
    """Configure and compile if the module is missing or stale (or ``force``); blocking."""
    digest = _digest()
    nanobind = _version("nanobind")
    current = _module_path()
    if not force and current is not None and _STAMP.is_file():
        built_digest, _, built_nanobind = _STAMP.read_text().strip().partition(" ")
        if built_digest == digest and nanobind in ("none", built_nanobind):
            return BuildResult(ok=True, built=False, message=f"up to date: {current.name}")
    cmake, cxx = _tool(_CMAKE), _tool(_CXX)
    if cmake is None or cxx is None:
        missing = " and ".join(n for n, p in (("cmake", cmake), ("g++", cxx)) if p is None)
        return BuildResult(ok=False, built=False, message=f"not built: no {missing} here")
    if nanobind == "none":
        return BuildResult(
            ok=False, built=False, message="not built: nanobind is not installed (setup.sh pins it)"
        )
    configure = [
        cmake,
        "-S",
        str(HERE),
        "-B",
        str(_BUILD_DIR),
        f"-DPython_EXECUTABLE={sys.executable}",
        f"-DCMAKE_CXX_COMPILER={cxx}",
        "-DCMAKE_BUILD_TYPE=Release",
    ]
    compile_ = [cmake, "--build", str(_BUILD_DIR), f"-j{jobs}"]
    for step in (configure, compile_):
        done = subprocess.run(step, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-20:]
            return BuildResult(
                ok=False,
                built=False,
                message="build failed: " + " ".join(step[:2]) + "\n" + "\n".join(tail),
            )
    built = sorted(_BUILD_DIR.glob("_ext.*.so"))
    if not built:
        message = f"build made no _ext.*.so in {_BUILD_DIR}"
        return BuildResult(ok=False, built=False, message=message)
    if current is not None:
        current.unlink()
    # Copy, then rename: a process that has the old module mapped keeps its inode.
    target = HERE / built[0].name
    tmp = target.with_suffix(".so.tmp")
    shutil.copy2(built[0], tmp)
    tmp.replace(target)
    _STAMP.write_text(f"{digest} {nanobind}\n")
    return BuildResult(ok=True, built=True, message=f"built {target.name}")
