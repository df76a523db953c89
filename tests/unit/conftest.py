"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


def native_isas() -> list[str]:
    """The instruction sets the native kernels run with on this CPU, best first ("avx512",
    "avx2"), within MLXCEL_NATIVE_ISA's cap; none where the kernels do not load."""
    import mlxcel.models.mlx_setup  # noqa: F401  (first: it preloads OpenBLAS)
    from mlxcel.native import available, kernel_isa

    if not available():
        return []
    return ["avx512", "avx2"] if kernel_isa() == "avx512" else [kernel_isa()]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Computed only for tests that ask for it: other unit tests need not import mlx.
    if "native_isa" in metafunc.fixturenames:
        metafunc.parametrize("native_isa", native_isas() or ["none"], indirect=True)


@pytest.fixture
def native_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a test once per instruction set the native kernels have here, the kernels capped
    to it for the test's duration (``_ext.set_isa_cap``); "none" where they do not load."""
    isa = str(request.param)
    if isa == "none":
        yield isa
        return
    from mlxcel.native import _ext

    before = _ext.kernel_isa()
    assert _ext.set_isa_cap(isa) == isa
    try:
        yield isa
    finally:
        _ext.set_isa_cap(before)
