"""Headless Chromium driven over the DevTools protocol, for the tests of what operators open in a browser.

`open_page(path)` starts Chromium (`--headless=new`, its own profile in a temporary directory, DevTools on a port
it picks and writes to `DevToolsActivePort`), connects to its one page over a WebSocket (aiohttp's client) and
navigates to the file; `Page.evaluate` runs JavaScript and returns its value, `Page.screenshot` the whole page as a
PNG, and `Page.errors` holds what the console reported as errors (console.error, uncaught exceptions, failed
loads) since the navigation. Every wait is bounded.

Also a command, to refresh the screenshots kept in the docs:
    python -m tests.browser REPORT.html OUT.png
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from subprocess import DEVNULL
from typing import Any

import aiohttp

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
TIMEOUT_S = 30.0


class Page:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._events: dict[str, asyncio.Event] = {}
        self.errors: list[str] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self._ws:
            data = msg.json()
            if "id" in data:
                future = self._replies.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
                continue
            method, params = data.get("method", ""), data.get("params", {})
            self._events.setdefault(method, asyncio.Event()).set()
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                self.errors.append(" ".join(str(a.get("value", a.get("description"))) for a in params["args"]))
            elif method == "Runtime.exceptionThrown":
                self.errors.append(params["exceptionDetails"].get("text", "exception"))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                self.errors.append(params["entry"].get("text", "error"))

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        ident = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._replies[ident] = future
        await self._ws.send_json({"id": ident, "method": method, "params": params})
        reply = await asyncio.wait_for(future, TIMEOUT_S)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return dict(reply.get("result", {}))

    async def navigate(self, url: str) -> None:
        loaded = self._events.setdefault("Page.loadEventFired", asyncio.Event())
        loaded.clear()
        reply = await self.send("Page.navigate", url=url)
        if reply.get("errorText"):
            raise RuntimeError(f"{url}: {reply['errorText']}")
        await asyncio.wait_for(loaded.wait(), TIMEOUT_S)

    async def evaluate(self, expression: str) -> Any:
        reply = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in reply:
            raise RuntimeError(f"evaluate: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    async def screenshot(self) -> bytes:
        reply = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        return base64.b64decode(reply["data"])

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


async def _devtools_port(profile: Path, process: asyncio.subprocess.Process) -> int:
    marker = profile / "DevToolsActivePort"
    for _ in range(int(TIMEOUT_S * 10)):
        if marker.exists() and marker.read_text().strip():
            return int(marker.read_text().split()[0])
        if process.returncode is not None:
            raise RuntimeError(f"chromium exited with {process.returncode}")
        await asyncio.sleep(0.1)
    raise TimeoutError("chromium wrote no DevToolsActivePort")


@asynccontextmanager
async def open_page(path: Path, width: int = 1280, height: int = 900) -> AsyncIterator[Page]:
    """Chromium showing the file at `path` (absolute; loaded: its load event fired), closed on exit."""
    if CHROMIUM is None:
        raise RuntimeError("no chromium on PATH")
    # its helper processes may still write to the profile as they exit: removal best-effort
    with tempfile.TemporaryDirectory(prefix="kvgate-chromium-", ignore_cleanup_errors=True) as profile:
        argv = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-extensions", "--disable-background-networking", "--remote-debugging-port=0",
                f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"]  # fmt: skip
        process = await asyncio.create_subprocess_exec(*argv, stdout=DEVNULL, stderr=DEVNULL, start_new_session=True)
        try:
            port = await _devtools_port(Path(profile), process)
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{port}/json/list") as resp:
                    targets = await resp.json()
                (url,) = [t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page"][:1]
                async with http.ws_connect(url, max_msg_size=256 << 20) as ws:
                    page = Page(ws)
                    try:
                        for domain in ("Page", "Runtime", "Log"):
                            await page.send(f"{domain}.enable")
                        await page.navigate(path.as_uri())
                        yield page
                    finally:
                        await page.close()
        finally:
            await _stop(process)


async def _stop(process: asyncio.subprocess.Process) -> None:
    """Chromium and its helper processes (its own process group), SIGTERM then SIGKILL after 10 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            await asyncio.wait_for(process.wait(), 10)
            return
        except TimeoutError:
            continue


async def _screenshot(report: Path, out: Path) -> None:
    async with open_page(report) as page:
        png = await page.screenshot()
        await asyncio.to_thread(out.write_bytes, png)
        if page.errors:
            raise SystemExit(f"console errors: {page.errors}")


if __name__ == "__main__":
    asyncio.run(_screenshot(Path(sys.argv[1]).resolve(), Path(sys.argv[2])))
