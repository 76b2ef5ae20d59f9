"""A real headless Chromium (Debian's `chromium`, which .ci/run installs) driven over the Chrome
DevTools protocol, through aiohttp's websocket client: no selenium or playwright.

    async with Page.open(tmp_path) as page:
        await page.goto(url)
        value = await page.evaluate("document.title")
        await page.screenshot(tmp_path / "shot.png")
        page.errors     # console errors, uncaught exceptions, failed loads, in order
        page.requests   # every URL the page asked for
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path

import aiohttp

CHROMIUM = "chromium"


def chromium_path() -> str | None:
    return shutil.which(CHROMIUM)


class Page:
    """One tab of a headless Chromium of its own (a fresh profile in a temporary folder)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self.errors: list[str] = []
        self.requests: list[str] = []
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._loaded = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    @staticmethod
    @contextlib.asynccontextmanager
    async def open(folder: Path, width: int = 1280, height: int = 1000):
        profile = folder / "chromium-profile"
        proc = subprocess.Popen(
            [chromium_path(), "--headless=new", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
             "--disable-extensions", "--disable-background-networking", "--disable-sync",
             "--disable-component-update", "--remote-debugging-port=0",
             f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            port = await _devtools_port(profile / "DevToolsActivePort", proc)
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/json/list") as r:
                    target = next(t for t in await r.json() if t["type"] == "page")
                async with session.ws_connect(target["webSocketDebuggerUrl"],
                                              max_msg_size=0) as ws:
                    page = Page(ws)
                    try:
                        for domain in ("Page", "Runtime", "Log", "Network"):
                            await page.send(f"{domain}.enable")
                        yield page
                    finally:
                        page._reader.cancel()
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    async def send(self, method: str, **params) -> dict:
        """A DevTools command; its result (a RuntimeError with the protocol's error)."""
        call = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._waiting[call] = future
        await self.ws.send_str(json.dumps({"id": call, "method": method, "params": params}))
        return await asyncio.wait_for(future, 60)

    async def _read(self) -> None:
        async for message in self.ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(message.data)
            if "id" in data:
                future = self._waiting.pop(data["id"])
                if "error" in data:
                    future.set_exception(RuntimeError(f"devtools: {data['error']}"))
                else:
                    future.set_result(data.get("result", {}))
            else:
                self._event(data["method"], data.get("params", {}))

    def _event(self, method: str, params: dict) -> None:
        if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            self.errors.append("console: " + " ".join(
                str(a.get("value", a.get("description", ""))) for a in params["args"]))
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.errors.append("exception: " + details.get("exception", {}).get(
                "description", details.get("text", "")))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.errors.append(f"log: {params['entry']['text']} {params['entry'].get('url', '')}")
        elif method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        elif method == "Page.loadEventFired":
            self._loaded.set()

    async def goto(self, url: str) -> None:
        """Navigates and waits for the load event."""
        self._loaded.clear()
        result = await self.send("Page.navigate", url=url)
        if result.get("errorText"):
            raise RuntimeError(f"{url}: {result['errorText']}")
        await asyncio.wait_for(self._loaded.wait(), 60)

    async def evaluate(self, expression: str):
        """The value of a JavaScript expression (JSON-able), awaited where it is a promise."""
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                                 awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 30.0):
        """Polls `expression` until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression} still falsy after {timeout} s")
            await asyncio.sleep(0.2)

    async def screenshot(self, path: Path) -> Path:
        shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path


async def _devtools_port(active_port: Path, proc: subprocess.Popen, timeout: float = 60) -> int:
    """The port Chromium writes to its profile's DevToolsActivePort once it listens."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode}")
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int(active_port.read_text().split()[0])
        await asyncio.sleep(0.1)
    raise TimeoutError(f"chromium did not open its DevTools port in {timeout} s")
