"""The README's walk of a chat request ("How it works") is the path the code takes: a chat request, streamed and
not, is followed through a cache-aware gateway with a profiler hook that records every product module whose code
runs on the request's behalf (a frame whose caller chain reaches the request handler; background tasks such as
health checks are not the request's), and the set equals the modules the README's section names, so neither can
drift from the other."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import pytest

import gateway
from simengine import SimConfig
from tests.conftest import gateway_over_sims

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "engine_pool", "policies", "cacheindex", "kvcommon")
SIM = SimConfig(model="sim", instant=True, block_size=16)
HANDLER = "_endpoint_handler.<locals>.handle"  # gateway/handlers.py: the route table's handler of every route


def readme_walk() -> set[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## How it works") :]
    section = section[: section.index("\n## ", 3)]
    walk = section[: section.index("**A stream survives its engine**")]
    return set(re.findall(rf"`((?:{'|'.join(PACKAGES)})/[a-z_/]+\.py)`", walk))


class Walk:
    """The product modules entered on the request handler's behalf, by a `sys.setprofile` hook."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self._roots = tuple(str(ROOT / p) + "/" for p in PACKAGES)

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(self._roots):
            return
        caller: FrameType | None = frame
        while caller is not None:
            if caller.f_code.co_qualname == HANDLER:
                self.modules.add(str(Path(frame.f_code.co_filename).relative_to(ROOT)))
                return
            caller = caller.f_back


@pytest.mark.skipif(
    not (ROOT / "README.md").exists() or not Path(gateway.__file__).is_relative_to(ROOT),
    reason="needs the source checkout (the README and the packages under it), not an installed wheel",
)
async def test_the_readmes_walk_names_the_modules_a_chat_request_enters(http: aiohttp.ClientSession) -> None:
    walk = Walk()
    overrides = {"routing": {"policy": "cache-aware"}, "cache": {"tokenizers": {"sim": "sim"}}}
    async with gateway_over_sims([SIM, SIM], **overrides) as (gw, _):
        body: dict[str, Any] = {"model": "sim", "messages": [{"role": "user", "content": "hello " * 50}]}
        async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:  # warm: first-use paths out
            assert resp.status == 200
        sys.setprofile(walk)
        try:
            for stream in (False, True):
                async with http.post(gw.url + "/v1/chat/completions", json={**body, "stream": stream}) as resp:
                    assert resp.status == 200 and await resp.read()
        finally:
            sys.setprofile(None)
    named = readme_walk()
    assert "gateway/handlers.py" in walk.modules and len(walk.modules) > 8
    assert sorted(walk.modules - named) == [], "entered but not named in the README's walk"
    assert sorted(named - walk.modules) == [], "named in the README's walk but not entered"
