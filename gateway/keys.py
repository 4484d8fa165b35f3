"""Typed application keys: how handlers reach the resources `gateway.app` creates (no globals)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry

from cacheindex.state import CacheAwareState
from engine_pool.discovery import DnsDiscovery
from engine_pool.http_client import UpstreamClient
from engine_pool.pool import EnginePool
from engine_pool.replica_set import ReplicaSet
from gateway.admission.controller import AdmissionController
from gateway.completion import CompletionService
from gateway.config import GatewayConfig
from gateway.config_load import ConfigSource
from gateway.fleet import RoutingShare
from gateway.ids import IdSource
from gateway.metrics import GatewayMetrics
from gateway.proxy import UpstreamProxy
from gateway.router import Router

CONFIG = web.AppKey("config", GatewayConfig)
REGISTRY = web.AppKey("registry", CollectorRegistry)
METRICS = web.AppKey("metrics", GatewayMetrics)
UPSTREAM = web.AppKey("upstream", UpstreamClient)  # the one HTTP client to engines (keep-alive pools)
REPLICAS = web.AppKey("replicas", ReplicaSet)
ROUTER = web.AppKey("router", Router)
PROXY = web.AppKey("proxy", UpstreamProxy)
ADMISSION = web.AppKey("admission", AdmissionController)
COMPLETIONS = web.AppKey("completions", CompletionService)  # the request path of every route (gateway/endpoints)
CONFIG_SOURCE = web.AppKey("config_source", ConfigSource)  # the file and flags `kvgate serve` loaded, for reloads
CACHE = web.AppKey("cache", CacheAwareState)  # running while the routing policy uses prefix overlap (cache_ctx)
FLEET = web.AppKey("fleet", RoutingShare)  # absent unless a Redis is configured and fleet.share_routing
POOL = web.AppKey("pool", EnginePool)  # the engines kvgate launched; absent without `pool:` in the config
DISCOVERY = web.AppKey("discovery", list[DnsDiscovery])  # one per `engines[].dns` entry (maybe none)

IDS = web.AppKey("ids", IdSource)  # request ids
REQUEST_ID = web.RequestKey("request_id", str)
