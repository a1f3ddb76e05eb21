"""Fixtures for the SBPFv0 toolchain tests: fixture programs built once per session, in a temp dir."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from sbpf_harness import MEASURED, build_fixture, clang_missing

SKIP_REASON = "clang-14 is not installed (apt-get install -y clang-14); C fixture programs cannot be built"


@pytest.fixture(scope="session")
def program(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], bytes]:
    """Builds a fixture program by name (once per session); skips only when clang-14 is not installed."""
    if clang_missing():
        pytest.skip(SKIP_REASON)
    cache: dict[str, bytes] = {}
    out_dir = tmp_path_factory.mktemp("sbpf")

    def get(name: str) -> bytes:
        if name not in cache:
            cache[name] = build_fixture(name, out_dir)
        return cache[name]

    return get


@pytest.fixture
def needs_clang() -> None:
    """For tests that run clang themselves: the same skip rule as `program`."""
    if clang_missing():
        pytest.skip(SKIP_REASON)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the compute units the fixture programs consumed, so every test run reports them."""
    if MEASURED:
        terminalreporter.section("SBPFv0 fixture programs: compute units")
        for name, units in MEASURED.items():
            terminalreporter.write_line(f"{name:<44} {units:>7,} CU")
