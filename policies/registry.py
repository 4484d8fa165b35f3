"""The one explicit list of routing policies. `build_policy` fails on an unknown name, naming the known ones.

Adding a policy: write its module (a class with `name`, `decide(view) -> Decision` and `Params`, the pydantic model
of its parameters (`policies.base.PolicyParams`), constructed from them) and add one line to `_POLICIES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Protocol

from policies.base import Policy, PolicyParams
from policies.cache_aware import CacheAware
from policies.least_load import LeastLoad
from policies.round_robin import RoundRobin


class PolicyClass(Protocol):
    """A policy class: its parameters' model, and the constructor taking them."""

    @property
    def Params(self) -> type[PolicyParams]: ...

    def __call__(self, params: Any) -> Policy: ...


_POLICIES: Mapping[str, PolicyClass] = MappingProxyType(
    {
        RoundRobin.name: RoundRobin,
        LeastLoad.name: LeastLoad,
        CacheAware.name: CacheAware,
    }
)


class UnknownPolicy(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown routing policy {name!r}; known: {', '.join(sorted(_POLICIES))}")
        self.name = name


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def params_model(name: str) -> type[PolicyParams]:
    """The pydantic model of the policy's parameters (UnknownPolicy for an unknown name)."""
    cls = _POLICIES.get(name)
    if cls is None:
        raise UnknownPolicy(name)
    return cls.Params


def build_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """The policy `name` with its parameters validated (pydantic.ValidationError, a ValueError, naming a bad one)."""
    cls = _POLICIES.get(name)
    if cls is None:
        raise UnknownPolicy(name)
    return cls(cls.Params.model_validate(params or {}))
