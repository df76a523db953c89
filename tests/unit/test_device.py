"""Which device serves, and what the CPU-tuned paths do when it is a GPU.

Most of these run on the CPU with the device faked (``device.on_cpu`` patched to False, or a
stand-in for ``mlx.core``): each GPU branch is then mlx's own kernel run on the CPU, which gives
the same numbers as the CPU path to float32 rounding. The tests marked ``needs_gpu`` check a real
CUDA run and are skipped without one.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.models import blas, device
from mlxcel.models.loader import load_model, native_enabled
from mlxcel.models.resolve import resolve_model

needs_gpu = pytest.mark.skipif(
    not mx.cuda.is_available(), reason="needs an NVIDIA GPU (mlx CUDA backend)"
)


def _core(kind: str, *, cuda: bool = False, metal: bool = False, name: str | None = None) -> Any:
    """A stand-in for ``mlx.core`` whose default device is ``kind``."""

    def device_info(d: object) -> dict[str, str]:
        if name is None:
            raise RuntimeError("no device info in this backend")
        return {"device_name": name}

    return SimpleNamespace(
        cpu="cpu",
        default_device=lambda: kind,
        cuda=SimpleNamespace(is_available=lambda: cuda),
        metal=SimpleNamespace(is_available=lambda: metal),
        device_info=device_info,
    )


def test_describe_names_the_device_mlx_picked() -> None:
    cuda = device.describe(_core("gpu", cuda=True, name="NVIDIA H200"))
    assert (cuda.kind, cuda.backend, cuda.label) == ("gpu", "cuda", "gpu (cuda: NVIDIA H200)")
    metal = device.describe(_core("gpu", metal=True, name="Apple M2 Max"))
    assert metal.label == "gpu (metal: Apple M2 Max)"
    assert device.describe(_core("cpu", name="AMD EPYC")).label == "cpu (AMD EPYC)"
    # A backend that names nothing still says which device it is.
    assert device.describe(_core("cpu")).label == "cpu"
    assert device.describe(_core("gpu", cuda=True)).label == "gpu (cuda)"


def test_describe_here_matches_mlx() -> None:
    here = device.describe()
    assert here.kind == ("cpu" if mx.default_device() == mx.cpu else "gpu")
    assert device.on_cpu() is (here.kind == "cpu")


@pytest.mark.skipif(sys.platform != "linux", reason="mlx's backend is a wheel of its own on Linux")
def test_exactly_one_backend_wheel_is_installed() -> None:
    # Each backend wheel writes mlx/lib/libmlx.so: two would overwrite each other
    # (tools/setup.sh removes the others when it switches).
    assert len(device.installed_backends()) == 1, device.installed_backends()


@pytest.mark.parametrize(
    ("wheels", "says"),
    [
        ((), "mlxcel[cpu]"),
        (("mlx-cuda-13",), "libcuda.so.1"),
        (("mlx-cpu", "mlx-cuda-12"), "several backend wheels"),
    ],
)
def test_a_backend_that_cannot_load_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, wheels: tuple[str, ...], says: str
) -> None:
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setitem(sys.modules, "mlx.core", None)  # `import mlx.core` raises ImportError
    monkeypatch.setattr(device, "installed_backends", lambda: wheels)
    with pytest.raises(device.NoBackend, match=says.replace("[", r"\[").replace(".", r"\.")):
        device.describe()


def test_cli_stops_with_the_backend_error() -> None:
    # As a user meets it: `mlxcel serve` where mlx.core cannot load (here: made unimportable).
    code = (
        "import sys; sys.modules['mlx.core'] = None; from mlxcel import cli; "
        "sys.exit(cli.main(['serve']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 1, result.stderr
    assert "error: mlx cannot load" in result.stderr
    assert "Traceback" not in result.stderr


def test_no_blas_warning_when_a_gpu_backend_is_installed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=blas.__name__)
    monkeypatch.setattr(device, "gpu_wheel_installed", lambda: True)
    blas._slow_cpu_matmuls("reference BLAS")
    monkeypatch.setattr(device, "gpu_wheel_installed", lambda: False)
    blas._slow_cpu_matmuls("reference BLAS")
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.WARNING]


def _bfloat16_copy(tiny_model_dir: Path, dest: Path) -> Path:
    shutil.copytree(tiny_model_dir, dest)
    weights = mx.load(str(dest / "model.safetensors"))
    assert isinstance(weights, dict)
    mx.save_safetensors(
        str(dest / "model.safetensors"),
        {k: v.astype(mx.bfloat16) for k, v in weights.items()},
        metadata={"format": "mlx"},
    )
    return dest


def test_weights_stay_as_stored_on_a_gpu(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlx.utils import tree_flatten

    folder = resolve_model(str(_bfloat16_copy(tiny_model_dir, tmp_path / "bf16")))

    def dtypes(loaded: Any) -> set[Any]:
        return {v.dtype for _, v in tree_flatten(loaded.model.parameters())}

    on_cpu = load_model(folder)
    # On the CPU the projections stay bfloat16 on the native kernels (where they are built) and
    # everything else is float32; without the kernels everything is float32.
    expected = {mx.float32, mx.bfloat16} if native_enabled() else {mx.float32}
    assert (on_cpu.dtype, dtypes(on_cpu)) == ("float32", expected)
    monkeypatch.setenv("MLXCEL_NATIVE", "0")
    assert dtypes(load_model(folder)) == {mx.float32}
    monkeypatch.delenv("MLXCEL_NATIVE")
    monkeypatch.setattr(device, "on_cpu", lambda: False)
    on_gpu = load_model(folder)
    assert (on_gpu.dtype, dtypes(on_gpu)) == ("bfloat16", {mx.bfloat16})
    # An explicit dtype still wins.
    assert load_model(folder, dtype="float32").dtype == "float32"


def test_embedder_on_a_gpu_runs_whole_on_mlx_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxcel.models.embedding import (
        SPLIT_MIN_ROWS,
        load_embedder,
        resolve_embedding_model,
    )
    from tests.support.tiny_reranker import MINILM

    texts = [f"sentence {i} is about {'cats ' * (i % 5)}and dogs" for i in range(13)]
    assert len(texts) >= 2 * SPLIT_MIN_ROWS  # the CPU would split this batch over two streams
    cpu = load_embedder(resolve_embedding_model(MINILM), role="embedding")
    expected = cpu.forward(cpu.encode_texts(texts))

    monkeypatch.setattr(device, "on_cpu", lambda: False)
    gpu = load_embedder(resolve_embedding_model(MINILM), role="embedding")
    got = gpu.forward(gpu.encode_texts(texts))
    # No CPU streams: the batch ran whole on the default device, through mlx's own GELU,
    # LayerNorm and attention (with the padding mask) instead of fast_math's.
    assert gpu._streams == []
    np.testing.assert_allclose(got, expected, atol=2e-5)


@needs_gpu
def test_gpu_is_the_device_that_serves() -> None:
    here = device.describe()
    assert (here.kind, here.backend) == ("gpu", "cuda")
    assert not device.on_cpu()


@needs_gpu
def test_gpu_forward_matches_the_cpu(tiny_model_dir: Path) -> None:
    # The tiny llama's logits on the GPU against the same weights on the CPU device.
    loaded = load_model(resolve_model(str(tiny_model_dir)))
    tokens = mx.array([[1, 2, 3, 4, 5, 6, 7, 8]])
    on_gpu = loaded.model(tokens)
    with mx.stream(mx.cpu):
        on_cpu = loaded.model(tokens)
    np.testing.assert_allclose(np.array(on_gpu), np.array(on_cpu), atol=1e-4, rtol=1e-3)


@needs_gpu
def test_gpu_server_says_so_in_props(tiny_server: Any) -> None:
    import httpx

    props = httpx.get(f"{tiny_server.base_url}/props").json()
    assert props["device"].startswith("gpu (cuda")


def test_setup_refuses_an_unknown_cuda_version() -> None:
    # Refused before it installs anything (no apt, no pip).
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        ["bash", str(root / "tools" / "setup.sh")],
        env={**os.environ, "MLXCEL_CUDA": "11"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert "MLXCEL_CUDA must be 12, 13 or unset" in result.stderr
