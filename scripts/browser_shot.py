"""Headless chromium over the DevTools protocol: open a URL, optionally click a tab by its text,
save a PNG. `python scripts/browser_shot.py URL OUT.png [TAB] [SECONDS]` (scripts/browser-pass.sh).

The Prefect UI is a single-page app that reads its tab from state, not from the URL, so a tab is
clicked the way a user would; the waits let its queries settle (a screenshot tool, not a test)."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import websockets

WIDTH, HEIGHT = 1400, 1000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _page_socket(port: int) -> str:
    for _ in range(150):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json") as answer:
                tabs = json.load(answer)
            return str(next(t for t in tabs if t["type"] == "page")["webSocketDebuggerUrl"])
        except (OSError, StopIteration, ValueError):
            await asyncio.sleep(0.2)
    raise SystemExit("chromium did not open its DevTools port")


async def shoot(url: str, out: Path, tab: str | None, settle: float) -> None:
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="browser-shot-", ignore_cleanup_errors=True) as profile:
        browser = subprocess.Popen(
            ["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", f"--remote-debugging-port={port}",
             f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            async with websockets.connect(await _page_socket(port), max_size=64 << 20) as ws:
                ids = iter(range(1, 1 << 30))

                async def call(method: str, **params: Any) -> dict[str, Any]:
                    n = next(ids)
                    await ws.send(json.dumps({"id": n, "method": method, "params": params}))
                    while True:
                        message = json.loads(await ws.recv())
                        if message.get("id") == n:
                            return dict(message.get("result", {}))

                await call(
                    "Emulation.setDeviceMetricsOverride",
                    width=WIDTH,
                    height=HEIGHT,
                    deviceScaleFactor=1,
                    mobile=False,
                )
                await call("Page.enable")
                await call("Page.navigate", url=url)
                await asyncio.sleep(settle)
                if tab:
                    found = await call("Runtime.evaluate", expression=_click(tab), returnByValue=True)
                    if not found.get("result", {}).get("value"):
                        raise SystemExit(f"no visible {tab!r} on {url}")
                    await asyncio.sleep(settle)
                shot = await call("Page.captureScreenshot", format="png")
                out.write_bytes(base64.b64decode(shot["data"]))
        finally:
            browser.kill()
            browser.wait()


def _click(text: str) -> str:
    return (
        "(() => { const e = [...document.querySelectorAll('button, a, [role=tab], li, span, div')]"
        f".find(x => x.textContent.trim() === {json.dumps(text)} && x.offsetParent !== null);"
        " if (e) { e.click(); return true } return false })()"
    )


if __name__ == "__main__":
    args = sys.argv[1:]
    asyncio.run(
        shoot(
            args[0],
            Path(args[1]),
            (args[2] if len(args) > 2 else "") or None,
            float(args[3]) if len(args) > 3 else 6.0,
        )
    )
    print("wrote", args[1])
