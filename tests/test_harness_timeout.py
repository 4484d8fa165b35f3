"""The per-test timeout ends a test that hangs on the event loop, and its teardown if that hangs too (uvloop logs
what pytest-timeout raises from its signal callback: such a test used to run on until CI's limit)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import asyncio

import pytest


@pytest.mark.timeout(1)
async def test_hangs() -> None:
    await asyncio.get_running_loop().create_future()


@pytest.fixture
async def teardown_hangs():
    yield
    await asyncio.get_running_loop().create_future()


@pytest.mark.timeout(1)
async def test_hangs_and_its_teardown_too(teardown_hangs: None) -> None:
    await asyncio.get_running_loop().create_future()


async def test_after_them() -> None:
    await asyncio.sleep(0)
"""


def test_a_test_hung_on_the_loop_fails_and_the_run_goes_on(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
         "-p", "tests.conftest", "-p", "no:cacheprovider", "-q", str(probe)],
        cwd=ROOT, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "2 failed, 1 passed, 1 error" in out, out
    assert "timed out: 1 pending tasks" in out and "test_probe.py" in out, out  # where it hung
