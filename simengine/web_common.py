"""What the aiohttp handlers of the simulated engine (simengine.server, simengine.generation) share: the app's key
of the engine, JSON replies, OpenAI-shaped error replies (`{"error": {"message", "type", "param", "code"}}`, the type
from the status phrase unless given) and the request body read as JSON (400 when it is not). Cost: O(body).
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from aiohttp import web

from simengine.engine import SimEngine
from simengine.protocol import bad_request, check_model, dumps, error_body

ENGINE_KEY = web.AppKey("sim_engine", SimEngine)


def json_reply(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=dumps)


def error_reply(status: int, message: str, err_type: str | None = None) -> web.Response:
    return json_reply(
        error_body(status, message, err_type or HTTPStatus(status).phrase.replace(" ", "") + "Error"), status
    )


async def read_body(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc


async def json_object(request: web.Request) -> tuple[SimEngine, dict[str, Any], str]:
    """The engine, the request's JSON object and the model it names (404 for another model)."""
    engine = request.app[ENGINE_KEY]
    body = await read_body(request)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return engine, body, check_model(body, engine.config, engine.adapters)
