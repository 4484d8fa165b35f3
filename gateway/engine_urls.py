"""Engine URLs in one form, so that one engine cannot be configured twice under two spellings.

`normalize` is the one normalisation of an attached engine's `url` (applied when the config is validated): scheme
and host in lower case, the scheme's default port dropped, no trailing slash; a query or fragment is refused (a base
URL has none). `replica_id` is the replica id an `engines[]` entry gets (its `name`, else host[:port][/path] of the
normalised URL). `duplicates` names every entry whose URL or replica id an earlier entry already has, by its path
(`engines.1.url: ...`), so `kvgate serve --check`, start-up and reload refuse it as a configuration error. Cost:
one `urlsplit` per URL at validation, one dict lookup per entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize(url: str) -> str:
    """The one spelling of an engine base URL; ValueError for one that is not http(s)://host[:port][/path]."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ValueError("must start with http:// or https://")
    if not parts.hostname:
        raise ValueError("names no host")
    if parts.query or parts.fragment:
        raise ValueError("a base URL has no query or fragment")
    netloc = parts.netloc.lower()
    if parts.port == _DEFAULT_PORTS[scheme]:  # also checks the port (ValueError when it is not one)
        netloc = netloc.rsplit(":", 1)[0]
    return urlunsplit((scheme, netloc, parts.path.rstrip("/"), "", ""))


def replica_id(url: str, name: str | None) -> str:
    """The id of an attached engine's replica: its name, else the normalised URL without its scheme."""
    return name or url.split("://", 1)[1]


def duplicates(engines: Sequence[tuple[str | None, str | None]]) -> list[str]:
    """For (url, name) of each `engines[]` entry (url already normalised; None for a DNS entry): one message per
    entry that repeats an earlier entry's engine or replica id."""
    problems: list[str] = []
    urls: dict[str, int] = {}
    ids: dict[str, int] = {}
    for i, (url, name) in enumerate(engines):
        if url is None:
            continue
        if url in urls:
            problems.append(f"engines.{i}.url: duplicate engine: {url} is also engines.{urls[url]}.url")
            continue
        urls[url] = i
        rid = replica_id(url, name)
        if rid in ids:
            field = "name" if name else "url"
            problems.append(f"engines.{i}.{field}: duplicate replica id {rid!r}: engines.{ids[rid]} has it too")
            continue
        ids[rid] = i
    return problems
