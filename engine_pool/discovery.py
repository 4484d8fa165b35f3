"""Engines found by DNS: a name (a Kubernetes headless Service, a Consul name, a compose service) resolved on an
interval, each address one attached replica, no Kubernetes API needed.

Every `interval_s` a `DnsTarget` is resolved with dnspython's async resolver (the system's resolv.conf with its
search domains, so a Kubernetes Service's short name works, or the `nameserver` given): with `srv` the SRV records
of the name (each target's port, the target then resolved to A and AAAA), otherwise the A and AAAA records of the
name at the configured `port`. The endpoints found are compared with the replicas this target added:
- a new endpoint becomes a replica `<id>-<address>:<port>` (URL `scheme://address:port`, KV events
  `tcp://address:<kv_events_port>` when that port is configured), added *not warm*: the replica set's health probe
  and model discovery run as for any attached engine, and one real completion (`ReplicaSet.warm_up`, the gate
  launched engines pass too) makes it routable; a failed warm-up is retried every interval while the record stays;
- a vanished endpoint drains: it takes no new requests at once, and is removed when its in-flight requests have
  finished (or after `drain_timeout_s`);
- an answer that the name has no such records (NXDOMAIN, no answer) is an empty set, so every endpoint drains; a
  failed resolution (timeout, SERVFAIL, no nameserver) changes nothing: a DNS outage must not empty the pool.
Cost: one query per interval (plus one pair per SRV target), an O(endpoints) diff; at most `max_endpoints` replicas
per target (the rest are logged and ignored), so a runaway record set cannot grow the pool without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from dataclasses import dataclass, field

import dns.asyncresolver
import dns.exception
import dns.rdatatype
import dns.resolver

from engine_pool.replica import Replica, ReplicaSettings, build_replica, tcp_endpoint
from engine_pool.replica_set import ReplicaSet

log = logging.getLogger("kvgate.discovery")


@dataclass(frozen=True, slots=True)
class DnsTarget:
    id: str  # prefix of the replica ids
    name: str  # the DNS name to resolve
    port: int | None = None  # engine port for A/AAAA records (SRV records carry their own)
    srv: bool = False
    scheme: str = "http"
    settings: ReplicaSettings = field(default_factory=ReplicaSettings)  # of every replica the name gives
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None
    interval_s: float = 5.0
    timeout_s: float = 2.0
    nameserver: str | None = None  # "host" or "host:port"; None = the system's resolver
    drain_timeout_s: float = 60.0
    warmup_prompt: str = "Hello"
    warmup_timeout_s: float = 60.0
    max_endpoints: int = 256


Endpoint = tuple[str, int]  # (address, port)


class ResolveFailed(Exception):
    """The name could not be resolved now (timeout, SERVFAIL): keep what is known."""


def _resolver(target: DnsTarget) -> dns.asyncresolver.Resolver:
    if target.nameserver is None:
        res = dns.asyncresolver.Resolver()
    else:
        host, sep, port = target.nameserver.rpartition(":")
        if not sep or ":" in host:  # no port, or a bare IPv6 address
            host, port = target.nameserver, ""
        res = dns.asyncresolver.Resolver(configure=False)
        res.nameservers = [host]
        if port:
            res.port = int(port)
    res.lifetime = target.timeout_s
    res.cache = None  # every round asks: records come and go, and TTLs of 0 are common for these names
    return res


async def _addresses(res: dns.asyncresolver.Resolver, name: str) -> list[str]:
    found: list[str] = []
    for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
        try:
            answer = await res.resolve(name, rdtype, search=True)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            continue
        except (dns.exception.Timeout, dns.resolver.NoNameservers) as exc:
            raise ResolveFailed(f"{name} {rdtype.name}: {exc}") from exc
        found += [r.to_text() for r in answer]
    return found


async def resolve(target: DnsTarget, res: dns.asyncresolver.Resolver | None = None) -> set[Endpoint]:
    """The endpoints the name stands for now; raises ResolveFailed when DNS cannot say."""
    res = res or _resolver(target)
    if not target.srv:
        assert target.port is not None
        return {(a, target.port) for a in await _addresses(res, target.name)}
    try:
        answer = await res.resolve(target.name, dns.rdatatype.SRV, search=True)
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
        return set()
    except (dns.exception.Timeout, dns.resolver.NoNameservers) as exc:
        raise ResolveFailed(f"{target.name} SRV: {exc}") from exc
    out: set[Endpoint] = set()
    for rec in answer:
        host = rec.target.to_text().rstrip(".")
        out |= {(a, int(rec.port)) for a in await _addresses(res, host)}
    return out


def _url_host(address: str) -> str:
    return f"[{address}]" if ipaddress.ip_address(address).version == 6 else address


class DnsDiscovery:
    """Keeps the replicas of one `DnsTarget` equal to what its name resolves to (module header)."""

    def __init__(self, target: DnsTarget, replicas: ReplicaSet) -> None:
        self.target = target
        self.replicas = replicas
        self._resolver = _resolver(target)
        self._known: dict[Endpoint, Replica] = {}
        self._warming: dict[Endpoint, asyncio.Task[None]] = {}
        self._draining: dict[Endpoint, tuple[Replica, asyncio.Task[None]]] = {}
        self._task: asyncio.Task[None] | None = None
        self.failing = 0  # failed resolutions in a row, up to now (0 after a success; the endpoints were kept)

    @property
    def endpoints(self) -> int:
        """Engines the name stands for now (draining ones not counted)."""
        return len(self._known)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"discovery:{self.target.id}")

    async def close(self) -> None:
        drains = [t for _, t in self._draining.values()]
        tasks = [t for t in (self._task, *self._warming.values(), *drains) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def _loop(self) -> None:
        while True:
            try:
                self.apply(await resolve(self.target, self._resolver))
                self.failing = 0
            except ResolveFailed as exc:
                self.failing += 1
                log.warning("discovery %s: %s; keeping %d engine(s)", self.target.id, exc, len(self._known))
            except Exception:  # any other failure of a round (a socket's OSError, a resolver's): the next one runs
                self.failing += 1
                log.exception("discovery %s: a resolution round failed; keeping %d engine(s)", self.target.id,
                              len(self._known))  # fmt: skip
            await asyncio.sleep(self.target.interval_s)

    def apply(self, endpoints: set[Endpoint]) -> None:
        """Add the new endpoints (not warm), drain the vanished ones."""
        for ep in sorted(endpoints - self._known.keys()):
            if len(self._known) >= self.target.max_endpoints:
                log.warning("discovery %s: more than %d endpoints, ignoring %s:%d", self.target.id,
                            self.target.max_endpoints, *ep)  # fmt: skip
                break
            self._add(ep)
        for ep in sorted(self._known.keys() - endpoints):
            self._drain(ep)

    def _add(self, ep: Endpoint) -> None:
        back = self._draining.pop(ep, None)
        if back is not None:  # the record came back while its replica drained: it serves again
            replica, task = back
            task.cancel()
            self._known[ep] = replica
            self.replicas.set_draining(replica, False)
            if not replica.warm:  # it vanished during its warm-up, which the drain cancelled
                self._warming[ep] = asyncio.create_task(self._warm(ep, replica), name=f"warm:{replica.id}")
            log.info("discovery %s: %s reappeared while draining", self.target.id, replica.id)
            return
        t = self.target
        address, port = ep
        host = _url_host(address)
        replica = build_replica(
            f"{t.id}-{host}:{port}",
            f"{t.scheme}://{host}:{port}",
            t.settings,
            managed=False,
            kv_events_endpoint=tcp_endpoint(host, t.kv_events_port),
            kv_events_replay_endpoint=tcp_endpoint(host, t.kv_events_replay_port),
        )
        replica.warm = False  # routable only after a real completion
        self.replicas.add(replica)
        self._known[ep] = replica
        self._warming[ep] = asyncio.create_task(self._warm(ep, replica), name=f"warm:{replica.id}")
        log.info("discovery %s: %s:%d appeared, warming up", t.id, address, port)

    async def _warm(self, ep: Endpoint, replica: Replica) -> None:
        try:
            while True:
                if replica.healthy and replica.model is not None:
                    error = await self.replicas.warm_up(
                        replica, replica.model, self.target.warmup_prompt, 1, self.target.warmup_timeout_s
                    )
                    if error is None:
                        self.replicas.set_warm(replica, True)
                        log.info("discovery %s: %s is warm", self.target.id, replica.id)
                        return
                    log.warning("discovery %s: %s: %s", self.target.id, replica.id, error)
                    await asyncio.sleep(self.target.interval_s)
                else:
                    await self.replicas.wait_changed(self.target.interval_s)
        finally:
            if self._warming.get(ep) is asyncio.current_task():  # not a newer warm-up of the same endpoint
                del self._warming[ep]

    def _drain(self, ep: Endpoint) -> None:
        replica = self._known.pop(ep)
        warming = self._warming.pop(ep, None)
        if warming is not None:
            warming.cancel()
        self.replicas.set_draining(replica, True)
        log.info("discovery %s: %s vanished, draining %d request(s)", self.target.id, replica.id, replica.in_flight)
        task = asyncio.create_task(self._remove_when_idle(ep, replica), name=f"drain:{replica.id}")
        self._draining[ep] = (replica, task)

    async def _remove_when_idle(self, ep: Endpoint, replica: Replica) -> None:
        if not await replica.wait_idle(self.target.drain_timeout_s):
            log.warning("discovery %s: %s still had %d request(s) after %.0f s; removed", self.target.id,
                        replica.id, replica.in_flight, self.target.drain_timeout_s)  # fmt: skip
        self._draining.pop(ep, None)
        await self.replicas.remove(replica.id)
        log.info("discovery %s: %s drained and removed", self.target.id, replica.id)
