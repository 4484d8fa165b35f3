"""The HTTP listener's configuration (`server:`): address, request and connection limits, logging, the realtime
sockets' bounds. Part of the gateway's typed configuration (gateway.config), which holds it as `server`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from gateway.engines_config import StrictModel


class ServerConfig(StrictModel):
    host: str = Field("127.0.0.1", description="listen address")
    port: int = Field(8000, ge=0, le=65535, description="listen port; 0 picks a free one")
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0, description="larger request bodies get 413")
    max_answer_bytes: int = Field(
        256 * 1024 * 1024,
        gt=0,
        description="largest whole (not streamed) answer read from an engine; a larger one is cut off and the "
        "client gets 502 (a stream's events are bounded at 64 MiB each)",
    )
    access_log: Literal["plain", "json", "off"] = Field(
        "plain",
        description="one line per request on the kvgate.access logger, whatever --log-level says: plain (logfmt), "
        "json (an object a line, with its time), or off (YAML's unquoted off/false and on/true are read as off and "
        "plain)",
    )
    route_headers: bool = Field(True, description="add x-kvgate-replica / x-kvgate-route-reason to responses")
    metrics_access: Literal["auto", "public", "admin"] = Field(
        "auto",
        description="who may read /metrics and the per-replica detail of /ready (tenant names, engine addresses): "
        "admin = only with the admin key as bearer (others get /ready's verdict alone, /metrics 401/404); public = "
        "anyone; auto = admin when admission.auth is on (ingress), public otherwise",
    )
    shutdown_grace_s: float = Field(
        30.0,
        ge=0,
        description="on SIGTERM, how long in-flight requests may finish; those left then end in their API's shape (a "
        "stream with an error event `shutting_down`, others 503 with Retry-After), within 2 s more; a second SIGTERM "
        "ends them at once",
    )
    head_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a request head not complete this long after its first byte (a connection's first request: "
        "after the connection opened) gets 408 (connection closed)",
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="a request body not received whole this long after its head gets 408"
    )
    send_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a client that takes none of what is sent to it for this long is disconnected: the rest of a "
        "whole answer after its handler ended, a realtime message or close (its connection's place and session "
        "slot are freed; streams are bounded by timeouts.stream_idle_s)",
    )
    keepalive_timeout_s: float = Field(
        3630.0,
        gt=0,
        description="an idle keep-alive connection closes after this (longer than load balancers keep theirs)",
    )
    max_connections: int | None = Field(
        None,
        ge=1,
        description="open client connections; at the bound the connection idle the longest between requests is "
        "closed for a new one, and with none idle one more is answered 503 and closed (default: half the process's "
        "file-descriptor limit, which is raised to its hard limit at start)",
    )
    realtime_max_sessions: int = Field(
        256, ge=1, description="/v1/realtime WebSocket sessions open at once; one more gets 503"
    )
    realtime_max_message_bytes: int = Field(
        8 * 1024 * 1024, gt=0, description="largest /v1/realtime message either way; a larger one closes it (1009)"
    )
    max_json_depth: int = Field(
        64,
        ge=4,
        le=512,
        description="request bodies nested deeper (arrays and objects) get 400 and never reach an engine (checked "
        "on orjson's decoded value, which stops at 1,024 levels itself, else before any parser reads the text)",
    )
    max_header_bytes: int = Field(8190, ge=256, description="longest request line or header line; longer gets 431")
    max_headers: int = Field(128, ge=8, description="most header lines in a request; more gets 431")
    max_head_bytes: int = Field(
        65536,
        ge=256,
        description="bytes of a request head in all (request line and headers); more gets 431 at once, without "
        "waiting for the head's end (max_header_bytes and max_headers bound each line and the count); at least "
        "max_header_bytes",
    )

    @model_validator(mode="after")
    def _one_line_fits(self) -> ServerConfig:
        if self.max_head_bytes < self.max_header_bytes:
            raise ValueError("max_head_bytes must be at least max_header_bytes (one line of the head must fit)")
        return self

    @field_validator("access_log", mode="before")
    @classmethod
    def _access_log_switch(cls, value: object) -> object:
        if isinstance(value, bool):  # YAML 1.1 reads an unquoted `off` / `on` as a boolean
            return "plain" if value else "off"
        return value
