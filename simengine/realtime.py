"""vLLM's realtime transcription WebSocket (`/v1/realtime`, vLLM 0.32 `entrypoints/speech_to_text/realtime`), as its
protocol goes: `session.created` on connect; the client's `session.update` names the model (an unknown one is an
`error` event, `model_not_found`); `input_audio_buffer.append` carries base64 audio; `input_audio_buffer.commit`
(before a model: `error`, `model_not_validated`) answers `transcription.delta` then `transcription.done` with usage.
The "transcription" describes the audio received (its byte count and checksum), so a test can tell every byte
arrived intact. Unknown events and invalid JSON are `error` events; the session stays open.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid

from aiohttp import WSMsgType, web

from simengine.web_common import ENGINE_KEY


async def realtime(request: web.Request) -> web.WebSocketResponse:
    engine = request.app[ENGINE_KEY]
    ws = web.WebSocketResponse(max_msg_size=32 * 1024 * 1024)
    await ws.prepare(request)
    engine.stats.realtime_sessions += 1
    await ws.send_json({"type": "session.created", "id": f"sess-{uuid.uuid4().hex}", "created": int(time.time())})
    model: str | None = None
    audio = bytearray()
    async for msg in ws:
        if msg.type != WSMsgType.TEXT:
            continue
        try:
            event = json.loads(msg.data)
        except ValueError:
            await _error(ws, "Invalid JSON", "invalid_json")
            continue
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "session.update":
            if event.get("model") != engine.config.model:
                await _error(ws, f"The model `{event.get('model')}` does not exist.", "model_not_found")
            else:
                model = event["model"]
        elif kind == "input_audio_buffer.append":
            try:
                audio += base64.b64decode(event.get("audio", ""), validate=True)
            except (binascii.Error, TypeError):
                await _error(ws, "Invalid audio data", "invalid_audio")
        elif kind == "input_audio_buffer.commit":
            if model is None:
                await _error(ws, "Model not validated.", "model_not_validated")
                continue
            text = f"{len(audio)} bytes, sum {sum(audio) % 65536}"
            await ws.send_json({"type": "transcription.delta", "delta": text})
            usage = {"prompt_tokens": len(audio) // 320, "completion_tokens": 1, "total_tokens": len(audio) // 320 + 1}
            await ws.send_json({"type": "transcription.done", "text": text, "usage": usage})
            audio.clear()
        else:
            await _error(ws, f"Unknown event type: {kind}", "unknown_event")
    return ws


async def _error(ws: web.WebSocketResponse, message: str, code: str) -> None:
    await ws.send_json({"type": "error", "error": message, "code": code})
