"""Writes docs/config-reference.md from the pydantic models, so the reference can never drift from the code.

Run: python scripts/config_reference.py  (tests check the committed file is current).
"""

from __future__ import annotations

import argparse
import re
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from gateway.config import GatewayConfig
from policies.registry import params_model, policy_names

OUT = Path(__file__).resolve().parent.parent / "docs" / "config-reference.md"


def _models_in(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        out += _models_in(arg)
    return out


def _type_name(annotation: object) -> str:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:  # a validated type: the type it validates
        return _type_name(args[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and any(
        typing.get_origin(a) is typing.Annotated for a in args
    ):
        return " | ".join(_type_name(a) for a in args)
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type):
        return annotation.__name__
    text = re.sub(r"\b[a-z_]+(?:\.[a-z_]+)*\.([A-Z]\w*)", r"\1", str(annotation).replace("typing.", ""))
    return text.replace("NoneType", "None")


def _default(field: FieldInfo) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
        if isinstance(value, BaseModel):
            return "(section)"
        return f"`{value!r}`"
    if field.default_factory is not None:
        try:
            value = field.default_factory()  # type: ignore[call-arg]
        except TypeError:
            return "(computed)"
        return "(section)" if isinstance(value, BaseModel) else f"`{value!r}`"
    return "**required**"


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def _bounds(field: FieldInfo) -> str:
    """` >= 0, < 1`: the field's numeric bounds, as its metadata declares them."""
    found = [f"{sign} {getattr(m, attr)}" for m in field.metadata for attr, sign in _BOUNDS if hasattr(m, attr)]
    return ", ".join(found)


def _section(field: FieldInfo) -> BaseModel | None:
    """The section a field holds by default (its keys' defaults are that instance's values), or None."""
    value = field.default
    if value is PydanticUndefined and field.default_factory is not None:
        try:
            value = field.default_factory()  # type: ignore[call-arg]
        except TypeError:
            return None
    return value if isinstance(value, BaseModel) else None


def rows(model: type[BaseModel], prefix: str, *, bounds: bool = False, instance: BaseModel | None = None) -> list[str]:
    """The table rows of `model`'s keys under `prefix`; `instance`: the section's shipped value, whose fields are
    the defaults shown (a section's default may differ from its model's, e.g. the shipped latency targets)."""
    out: list[str] = []
    nested: list[tuple[str, type[BaseModel], BaseModel | None]] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        desc = (field.description or "").replace("|", "\\|")
        kind = _type_name(field.annotation).replace("|", "\\|")
        if bounds and _bounds(field):
            kind += f" ({_bounds(field)})"
        value = getattr(instance, name) if instance is not None else None
        shown = f"`{value!r}`" if instance is not None and not isinstance(value, BaseModel) else _default(field)
        shown = shown.replace("|", "\\|")
        out.append(f"| `{path}` | {kind} | {shown} | {desc} |")
        origin = typing.get_origin(field.annotation)
        for sub in _models_in(field.annotation):
            is_list = origin in (list, typing.List) or (  # noqa: UP006
                origin in (typing.Union, types.UnionType) and "list[" in str(field.annotation)
            )
            is_dict = "dict[" in str(field.annotation)
            suffix = "[]." if is_list else ".<name>." if is_dict else "."
            section = value if isinstance(value, BaseModel) else _section(field) if suffix == "." else None
            nested.append((path + suffix, sub, section if isinstance(section, sub) else None))
    for path, sub, section in nested:
        out += rows(sub, path, instance=section)
    return out


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the pydantic models by `python scripts/config_reference.py`; every key is checked at start-up",
        "(unknown keys are errors naming their path). Environment overrides: `KVGATE__SECTION__KEY=value`.",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
        *rows(GatewayConfig, ""),
        "",
        "## `routing.params`, per policy",
        "",
        "Each policy's parameters are a model of their own (`Params` in its module), checked when `routing` is;",
        "a bad one names its path (`routing.params.imbalance_cost: Input should be greater than or equal to 0`).",
        "",
    ]
    for name in policy_names():
        model = params_model(name)
        lines.append(f"### `routing.policy: {name}`")
        lines.append("")
        if not model.model_fields:
            lines += ["No parameters.", ""]
            continue
        table = rows(model, "routing.params.", bounds=True)
        lines += ["| key | type | default | meaning |", "|---|---|---|---|", *table, ""]
    return "\n".join(lines)


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help prints, writes nothing
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
