"""Headless Chromium for tests, driven through chromedriver's W3C WebDriver endpoints with
httpx (no selenium: a handful of calls). Skips where Debian's ``chromium`` and
``chromium-driver`` are not installed (``.ci/run`` installs them)."""

from __future__ import annotations

import base64
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.stores import free_port, stop, wait_for_port


class Browser:
    """One WebDriver session: open a page, run a script in it, take a screenshot."""

    def __init__(self, driver_url: str, session_id: str) -> None:
        self.url = f"{driver_url}/session/{session_id}"
        self.client = httpx.Client(timeout=60)

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        reply = self.client.request(method, f"{self.url}{path}", json=body)
        value = reply.json()["value"]
        if reply.status_code != 200:
            raise RuntimeError(f"WebDriver {method} {path}: {value.get('error')}: {value.get('message')}")
        return value

    def open(self, url: str) -> None:
        self._call("POST", "/url", {"url": url})

    def run(self, script: str, *args: Any) -> Any:
        """The value of ``script`` (a function body: ``return ...``) run in the page."""
        return self._call("POST", "/execute/sync", {"script": script, "args": list(args)})

    def wait_for(self, script: str, timeout_s: float = 120.0) -> Any:
        """Run ``script`` until it returns something truthy; that value (``timeout_s``: a safety net)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.run(script)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"not true after {timeout_s} s: {script}")
            time.sleep(0.2)

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self._call("GET", "/screenshot")))

    def close(self) -> None:
        self._call("DELETE", "")
        self.client.close()


@contextmanager
def headless_chromium(width: int = 1280, height: int = 900) -> Iterator[Browser]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip(
            "headless Chromium needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; "
            ".ci/run does)"
        )
    port = free_port()
    process = subprocess.Popen([driver, f"--port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, process, 30.0)
        driver_url = f"http://127.0.0.1:{port}"
        options = {
            "binary": chromium,
            "args": [
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                f"--window-size={width},{height}",
            ],
        }
        reply = httpx.post(
            f"{driver_url}/session",
            json={"capabilities": {"alwaysMatch": {"goog:chromeOptions": options}}},
            timeout=120,
        )
        value = reply.json()["value"]
        if reply.status_code != 200:
            raise RuntimeError(f"chromedriver could not start Chromium: {value.get('message')}")
        browser = Browser(driver_url, value["sessionId"])
        try:
            yield browser
        finally:
            browser.close()
    finally:
        stop(process)
