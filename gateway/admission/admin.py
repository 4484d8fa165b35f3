"""`POST /admin/reload` (bearer = `admin.key`): swap the admission config without a restart.

An empty body re-reads the config file the gateway was started with (file + environment, like SIGHUP); a JSON body
is taken as the new `admission` section (either `{"admission": {...}}` or the section itself). In-flight and queued
requests are not touched.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from pydantic import ValidationError

from gateway.admission.auth import check_admin
from gateway.admission.config import AdmissionConfig
from gateway.config import format_validation_error
from gateway.errors import BadRequest
from gateway.keys import ADMISSION, CONFIG


async def reload_admission(request: web.Request) -> web.Response:
    check_admin(request.headers, request.app[CONFIG].admin.key)
    controller = request.app[ADMISSION]
    raw = await request.read()
    try:
        if raw.strip():
            data = json.loads(raw)
            if isinstance(data, dict) and "admission" in data:
                data = data["admission"]
            config = AdmissionConfig.model_validate(data)
        elif controller.reload_source is not None:
            config = await asyncio.to_thread(controller.reload_source)
        else:
            raise BadRequest("no config file to re-read: send the admission section as the JSON body")
    except ValueError as exc:
        message = format_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
        raise BadRequest(message) from None
    controller.reload(config)
    return web.json_response({"reloaded": True, "tenants": sorted(config.tenants), "auth": config.auth})
