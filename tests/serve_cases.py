"""Pieces the `mmgen serve` tests share: a real server subprocess on loopback and reference SHAs.

`ServerProcess` runs `python -m mmgen.cli serve --port 0` (the port the system picks is read from
its first stdout line), waits, bounded in time, until /health answers 200, and is always stopped
(SIGTERM, then SIGKILL). `reference_frames_sha256` is what `mmgen generate` prints for a request;
`refused_edit` is POST /v1/images/edits through the `openai` client, answered with a 400.
`chromium()` is a headless Debian chromium under Selenium for the page at / (the test skips when
chromium / chromium-driver are not installed; .ci/run installs them); `page_image_sha256` makes one
image through that page on an image model.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

PROMPT = "a red circle moves left on a black background"
# A fast job on the default model: 48x48, 9 frames, 2 steps.
FAST = {"size": "48x48", "num_frames": 9, "num_inference_steps": 2}
START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 120


class ServerProcess:
    """`mmgen serve` in a subprocess on 127.0.0.1 and a free port; use as a context manager."""

    def __init__(self, state: Path, model: Path, *extra: str, api_key: str | None = None) -> None:
        self.state = Path(state)
        self.state.mkdir(parents=True, exist_ok=True)
        self.api_key = api_key
        self.log = self.state.parent / f"{self.state.name}.log"
        self.command = [
            sys.executable, "-m", "mmgen.cli", "serve", "--port", "0", "--state", str(state),
            "--model", str(model), "--device", "cpu", *extra,
        ]  # fmt: skip
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        env = {**os.environ}
        if self.api_key is not None:
            env["MMGEN_API_KEY"] = self.api_key
        out = self.state.parent / f"{self.state.name}.stdout"
        with open(out, "w") as stdout, open(self.log, "a") as stderr:
            self.proc = subprocess.Popen(self.command, env=env, stdout=stdout, stderr=stderr)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.url:
            self._check_alive()
            assert time.monotonic() < deadline, f"no 'listening' line in {START_TIMEOUT_S} s"
            for line in out.read_text().splitlines():
                if "listening on " in line:
                    self.url = line.split("listening on ", 1)[1].strip()
            time.sleep(0.05)
        while self.request("GET", "/health")[0] != 200:
            self._check_alive()
            assert time.monotonic() < deadline, f"/health not 200 in {START_TIMEOUT_S} s"
            time.sleep(0.1)

    def _check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"server exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def request(
        self, method: str, path: str, body: Any = None, *, key: str | None = "", headers: dict | None = None
    ) -> tuple[int, Any]:
        """(status, decoded JSON or bytes) of one HTTP request; key '' = the server's key, None = no header."""
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        sent = {"content-type": "application/json", **(headers or {})}
        key = self.api_key if key == "" else key
        if key is not None:
            sent["authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=sent)
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                status, raw, kind = response.status, response.read(), response.headers.get("content-type", "")
        except urllib.error.HTTPError as err:
            status, raw, kind = err.code, err.read(), err.headers.get("content-type", "")
        except (urllib.error.URLError, ConnectionError):
            return 0, None
        return status, json.loads(raw) if kind.startswith("application/json") else raw

    def wait_idle(self, timeout: float = JOB_TIMEOUT_S) -> None:
        """Wait (bounded) until no job is queued or running, as /metrics counts them."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.request("GET", "/metrics")[1].decode()
            unfinished = ('mmgen_jobs{status="queued"}', 'mmgen_jobs{status="in_progress"}')
            busy = [
                line
                for line in text.splitlines()
                if line.startswith(unfinished) and not line.endswith(" 0.0")
            ]
            if not busy:
                return
            assert time.monotonic() < deadline, f"still busy after {timeout} s: {busy}"
            time.sleep(0.05)

    def wait_for(self, video_id: str, statuses: tuple[str, ...], timeout: float = JOB_TIMEOUT_S) -> dict:
        """GET the video until its status is one of `statuses` (bounded in time)."""
        deadline = time.monotonic() + timeout
        while True:
            status, job = self.request("GET", f"/v1/videos/{video_id}")
            assert status == 200, (status, job)
            if job["status"] in statuses:
                return job
            assert time.monotonic() < deadline, f"{video_id} still {job['status']} after {timeout} s"
            time.sleep(0.05)


@functools.lru_cache(maxsize=8)
def reference_frames_sha256(model: Path, seed: int, steps: int = 2, frames: int = 9) -> str:
    """The frames_sha256 `mmgen generate` prints for PROMPT at 48x48 (run in this process)."""
    from mmgen.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(
            [
                "generate", PROMPT, "--model", str(model), "--device", "cpu", "--height", "48",
                "--width", "48", "--frames", str(frames), "--steps", str(steps), "--seed", str(seed),
                "--out", str(model.parent / f"reference-{seed}-{steps}-{frames}.mp4"), "--no-progress",
            ]
        )  # fmt: skip
    assert code == 0, out.getvalue()
    lines = dict(line.split(": ", 1) for line in out.getvalue().splitlines() if ": " in line)
    return lines["frames_sha256"]


def refused_edit(server: ServerProcess, client: Any, image: Path) -> dict[str, Any]:
    """The error of `client.images.edit(image=...)` (the official openai client), which must be a 400
    that stored no upload: {"message", "type", "param", "code"}."""
    import openai

    before = set((server.state / "uploads").glob("*/*"))
    with open(image, "rb") as fh, pytest.raises(openai.BadRequestError) as caught:
        client.images.edit(image=fh, prompt=PROMPT, size="48x32", extra_body={"seed": 1})
    assert set((server.state / "uploads").glob("*/*")) == before
    error = caught.value.body if isinstance(caught.value.body, dict) else {}
    return error.get("error", error)


CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1000,700",
)


def chromium() -> Any:
    """A headless chromium WebDriver (the caller quits it); skips the test without chromium or selenium."""
    if not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()):
        pytest.skip("chromium / chromium-driver not installed (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    return webdriver.Chrome(
        options=options, service=webdriver.ChromeService(executable_path=str(CHROMEDRIVER))
    )


def page_image_sha256(
    server: ServerProcess, fields: dict[str, str], *, ready: Any, files: dict[str, Path] | None = None
) -> str:
    """The png sha256 the page at / shows once an image model made an image of `fields` (input id ->
    text) and `files` (file input id -> path), submitted with the server's key after `ready(driver)`;
    an error the page shows fails the test."""
    driver = chromium()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, 90, poll_frequency=0.1)
    try:
        driver.get(server.url + "/")
        wait.until(ready)
        driver.find_element(By.ID, "key").send_keys(server.api_key or "")
        for name, value in {**fields, **{name: str(path) for name, path in (files or {}).items()}}.items():
            driver.find_element(By.ID, name).send_keys(value)
        driver.find_element(By.ID, "submit").click()
        wait.until(lambda d: d.find_element(By.ID, "sha").text or d.find_element(By.ID, "error").text)
        assert driver.find_element(By.ID, "error").text == ""
        return driver.find_element(By.ID, "sha").text
    finally:
        driver.quit()
