"""Write the recommended gate into a kvgate YAML config: `admission.replica_max_concurrency: N`, and (`kvgate
plan`) one pool model's `max_num_seqs`.

The edit is textual so comments, order and formatting survive: in a block-style top-level `admission:` mapping the
`replica_max_concurrency:` line gets the new value (keeping its trailing comment) or is inserted as the first child;
without an `admission:` key the section is appended. The result is checked by parsing both texts: the new one must
equal the old one with exactly that key set. When the text edit cannot be done that way (flow style, anchors, ...)
the file is rewritten from the parsed data with `yaml.safe_dump` (comments lost). Written atomically (temp file +
rename). O(lines). A pool model's key (`set_model_key_text`): in the `- name: MODEL` item of the config, the key's
line at the item's indentation gets the value, or is inserted after the name; checked, with the same fallback.
"""

from __future__ import annotations

import copy
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

SECTION = "admission"
KEY = "replica_max_concurrency"
_TOP_RE = re.compile(rf"^{SECTION}:\s*(#.*)?$")
_KEY_RE = re.compile(rf"^(\s+){KEY}:([^#\n]*)(#.*)?$")


class GateConfigError(ValueError):
    """The config cannot be read or is not a YAML mapping."""


def _expected(data: dict[str, Any], value: int) -> dict[str, Any]:
    out = copy.deepcopy(data)
    section = out.get(SECTION)
    if not isinstance(section, dict):
        section = {}
        out[SECTION] = section
    section[KEY] = value
    return out


def _edit_text(text: str, value: int) -> str:
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if _TOP_RE.match(line.rstrip("\n"))), None)
    if start is None:
        sep = "" if not text or text.endswith("\n") else "\n"
        return f"{text}{sep}{SECTION}:\n  {KEY}: {value}\n"
    body = [i for i in range(start + 1, len(lines)) if lines[i].strip() and not lines[i].lstrip().startswith("#")]
    end = next((i for i in body if not lines[i][0].isspace()), len(lines))
    first = lines[body[0]] if body and body[0] < end else ""
    indent = first[: len(first) - len(first.lstrip())] if first else "  "
    for i in range(start + 1, end):
        m = _KEY_RE.match(lines[i].rstrip("\n"))
        if m and m.group(1) == indent:
            comment = f"  {m.group(3)}" if m.group(3) else ""
            lines[i] = f"{indent}{KEY}: {value}{comment}\n"
            return "".join(lines)
    lines.insert(start + 1, f"{indent}{KEY}: {value}\n")
    return "".join(lines)


def set_gate_text(text: str, value: int) -> str:
    """The config text with admission.replica_max_concurrency = value (module header)."""
    if value < 1:
        raise ValueError("the gate must be >= 1")
    try:
        data = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as exc:
        raise GateConfigError(f"not valid YAML: {exc}") from exc
    data = data or {}
    if not isinstance(data, dict):
        raise GateConfigError("the config must be a YAML mapping at the top level")
    want = _expected(data, value)
    try:
        edited = _edit_text(text, value)
        if yaml.safe_load(edited) == want:
            return edited
    except yaml.YAMLError:
        pass
    return yaml.safe_dump(want, sort_keys=False)


_ITEM_RE = re.compile(r"""^(\s*)-\s+name:\s*['"]?([^'"#\s]+)['"]?\s*(#.*)?$""")


def pool_models(text: str) -> list[str]:
    """Names of the pool's models in a config text ([] when it has no pool)."""
    data = yaml.safe_load(text) if text.strip() else {}
    models = ((data or {}).get("pool") or {}).get("models") or [] if isinstance(data, dict) else []
    return [str(m.get("name")) for m in models if isinstance(m, dict)]


def _edit_model_text(text: str, model: str, key: str, value: int) -> str:
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        m = _ITEM_RE.match(line.rstrip("\n"))
        if not m or m.group(2) != model:
            continue
        dash = len(m.group(1))
        child = " " * (dash + 2)
        key_re = re.compile(rf"^{child}{key}:([^#\n]*)(#.*)?$")
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > dash):
            km = key_re.match(lines[j].rstrip("\n"))
            if km:
                comment = f"  {km.group(2)}" if km.group(2) else ""
                lines[j] = f"{child}{key}: {value}{comment}\n"
                return "".join(lines)
            j += 1
        lines.insert(i + 1, f"{child}{key}: {value}\n")
        return "".join(lines)
    raise GateConfigError(f"no pool model named {model!r}")


def set_model_key_text(text: str, model: str, key: str, value: int) -> str:
    """The config text with pool.models[name == model][key] = value (module header)."""
    try:
        data = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as exc:
        raise GateConfigError(f"not valid YAML: {exc}") from exc
    models = ((data or {}).get("pool") or {}).get("models") if isinstance(data, dict) else None
    if not isinstance(models, list) or not any(isinstance(m, dict) and m.get("name") == model for m in models):
        raise GateConfigError(f"no pool model named {model!r}")
    want = copy.deepcopy(data)
    for m in want["pool"]["models"]:
        if isinstance(m, dict) and m.get("name") == model:
            m[key] = value
    try:
        edited = _edit_model_text(text, model, key, value)
        if yaml.safe_load(edited) == want:
            return edited
    except yaml.YAMLError:
        pass
    return yaml.safe_dump(want, sort_keys=False)


def write_config_text(path: str | Path, edit: Callable[[str], str]) -> None:
    """Applies `edit` to the config at path (created when missing), atomically."""
    p = Path(path)
    try:
        text = p.read_text() if p.exists() else ""
    except OSError as exc:
        raise GateConfigError(f"cannot read {p}: {exc}") from exc
    new = edit(text)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(new)
        os.replace(tmp, p)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_gate(path: str | Path, value: int) -> None:
    """Sets the gate in the config at path (created when missing)."""
    write_config_text(path, lambda text: set_gate_text(text, value))
