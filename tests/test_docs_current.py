"""The committed configuration reference is generated from the models; it must match them."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    not (ROOT / "docs").is_dir(), reason="needs the source checkout (the bare-install run has tests/ only)"
)
def test_config_reference_is_current() -> None:
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = (ROOT / "docs" / "config-reference.md").read_text()
    assert committed == module.render(), "run `python scripts/config_reference.py` and commit docs/config-reference.md"
