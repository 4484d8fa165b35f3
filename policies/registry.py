"""The one explicit list of routing policies. `build_policy` fails on an unknown name, naming the known ones.

Adding a policy: write its module (a class with `name` and `decide(view) -> Decision`, constructed from a params
mapping that it validates) and add one line to `_FACTORIES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from policies.base import Policy
from policies.cache_aware import CacheAware
from policies.least_load import LeastLoad
from policies.round_robin import RoundRobin

PolicyFactory = Callable[[Mapping[str, Any]], Policy]

_FACTORIES: Mapping[str, PolicyFactory] = MappingProxyType(
    {
        RoundRobin.name: RoundRobin,
        LeastLoad.name: LeastLoad,
        CacheAware.name: CacheAware,
    }
)


class UnknownPolicy(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown routing policy {name!r}; known: {', '.join(sorted(_FACTORIES))}")
        self.name = name


def policy_names() -> list[str]:
    return sorted(_FACTORIES)


def build_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    factory = _FACTORIES.get(name)
    if factory is None:
        raise UnknownPolicy(name)
    return factory(params or {})
