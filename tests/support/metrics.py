"""Reading a server's /metrics in tests: one sample's value, or a wait until it holds; and
whether its /slots all went idle."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families


def sample(base_url: str, name: str, **labels: str) -> float | None:
    """The value of ``name`` with exactly these labels (None when absent)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return None


def wait_for(
    base_url: str,
    name: str,
    holds: Callable[[float], bool],
    *,
    timeout: float = 60.0,
    **labels: str,
) -> float:
    """Poll until the sample exists and ``holds``; its value. A deadline, not a guess of how
    long the server needs: a busy machine only makes it wait longer."""
    deadline = time.monotonic() + timeout
    while True:
        value = sample(base_url, name, **labels)
        if value is not None and holds(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}{labels} = {value} after {timeout} s")
        time.sleep(0.02)


def slots_idle(base_url: str, timeout: float = 5.0) -> bool:
    """Whether every slot stops processing within ``timeout`` (a row ends at its next step,
    which may come just after the request that stopped it was answered)."""
    deadline = time.monotonic() + timeout
    while any(s["is_processing"] for s in httpx.get(f"{base_url}/slots", timeout=10).json()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
