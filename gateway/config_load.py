"""Loading the configuration: one YAML file, then environment overrides, then CLI flags, validated whole
(`gateway.config.GatewayConfig`) before serving.

Environment overrides use `KVGATE__SECTION__KEY=value` (double underscores between path parts, values parsed as
YAML scalars, a string key's value as written), e.g. `KVGATE__SERVER__PORT=9000`. A validation error names the
dotted path of each bad key (`routing.policy: unknown routing policy 'x'`). Cost: one validation of the whole tree.
"""

from __future__ import annotations

import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from gateway.config import GatewayConfig


class ConfigError(ValueError):
    """Configuration that cannot be served; the message lists every bad key by its dotted path."""


_OWN_PATH = re.compile(r"([A-Za-z_][\w-]*(?:\.[\w-]+)+): ")


def format_validation_error(err: ValidationError, section: str | None = None) -> str:
    """Each error on a line with its dotted path (under `section` when a section was validated alone)."""
    lines = []
    for e in err.errors():
        message = e["msg"].removeprefix("Value error, ")
        loc = [section] if section else []
        loc += [str(p) for p in e["loc"]]
        # a check of a whole section names its own paths below it (`tenants.a.priority: ...`): joined to the
        # section's, so every line starts with the key's full path
        if loc and (named := _OWN_PATH.match(message)):
            loc.append(named[1])
            message = message[named.end() :]
        lines.append(f"{'.'.join(loc)}: {message}" if loc else message)
    return "invalid configuration:\n  " + "\n  ".join(lines)


_UNIONS = (typing.Union, types.UnionType)


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


def env_overrides(environ: Mapping[str, str], prefix: str = "KVGATE__") -> dict[str, Any]:
    """`KVGATE__SECTION__KEY=value` as a nested dict: the value as YAML (numbers, booleans, lists), but as it is
    written for a key whose type is a string (a key `123`, `off` or `#secret` stays that string)."""
    tree: dict[str, Any] = {}
    for key, raw in environ.items():
        if key.startswith(prefix) and len(key) > len(prefix):
            path = [p.lower() for p in key[len(prefix) :].split("__")]
            if not raw or _is_text(GatewayConfig, path, raw):
                _set_path(tree, path, raw)
                continue
            try:
                _set_path(tree, path, yaml.safe_load(raw))
            except yaml.YAMLError as exc:
                raise ConfigError(f"{key}: not a YAML value: {str(exc).splitlines()[0]}") from None
    return tree


def _is_text(model: type[BaseModel], path: list[str], raw: str) -> bool:
    """Whether the config key at `path` takes `raw` as written: a string key (and nothing else but null), or a
    choice of strings that `raw` is one of (`access_log: false` is YAML's false, as in the file)."""
    annotation: Any = model
    for i, part in enumerate(path):
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found = annotation.model_fields.get(part)
            if found is None:
                return False
            annotation = found.annotation
        elif get_origin(annotation) is dict and i:  # a table's key (a tenant's name): its value's type
            annotation = get_args(annotation)[1]
        else:
            return False
        args = [a for a in get_args(annotation) if a is not type(None)] if get_origin(annotation) in _UNIONS else []
        if len(args) == 1:
            annotation = args[0]
        if get_origin(annotation) is typing.Annotated:
            annotation = get_args(annotation)[0]
    if get_origin(annotation) is typing.Literal:
        return raw in get_args(annotation)
    return annotation is str


def _cased_like(tree: dict[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """Environment keys (upper-cased by convention, read lower-cased) spelled as the file spells them: a tenant
    named `TeamA` in the file is overridden by `KVGATE__ADMISSION__TENANTS__TEAMA__...`."""
    spelled = {k.lower(): k for k in base if isinstance(k, str)}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = key if key in base else spelled.get(key, key)
        below = base.get(name)
        out[name] = _cased_like(value, below) if isinstance(value, dict) and isinstance(below, Mapping) else value
    return out


def deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    path: str | Path | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> GatewayConfig:
    """File, then environment, then `overrides` (CLI flags as a nested dict); raises ConfigError."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config {path} must be a mapping at the top level")
        data = loaded or {}
    data = deep_merge(data, _cased_like(env_overrides(os.environ if environ is None else environ), data))
    data = deep_merge(data, overrides or {})
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from exc


@dataclass(frozen=True)
class ConfigSource:
    """Where the running configuration came from, read again by a reload (SIGHUP, `POST /admin/reload`): the file,
    then the environment, then the command line's flags (`overrides`), as at start-up."""

    path: str
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def load(self) -> GatewayConfig:
        return load_config(self.path, overrides=self.overrides)
