"""Typed application keys: how handlers reach the resources `gateway.app` creates (no globals)."""

from __future__ import annotations

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from engine_pool.replica_set import ReplicaSet
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.proxy import UpstreamProxy
from gateway.router import Router

CONFIG = web.AppKey("config", GatewayConfig)
REGISTRY = web.AppKey("registry", CollectorRegistry)
METRICS = web.AppKey("metrics", GatewayMetrics)
CLIENT = web.AppKey("client", aiohttp.ClientSession)
REPLICAS = web.AppKey("replicas", ReplicaSet)
ROUTER = web.AppKey("router", Router)
PROXY = web.AppKey("proxy", UpstreamProxy)
