"""`mmgen serve` while its model loads, through the official `openai` client on loopback.

The server runs in this process (uvicorn in a thread, an ephemeral 127.0.0.1 port) over a Service
whose loader waits until the test lets it go, so "while loading" lasts as long as the test needs:
every route but /health (and the static page and /metrics) answers 503, GET /v1/models included; a
POST the request value alone refuses (a bad size) is a 400 naming the field sent, with no weights
loaded; once loaded, the client's readiness poll of /v1/models passes and its first
`videos.create` is accepted and completes with `mmgen generate`'s frames.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_cases import FAST, PROMPT, reference_frames_sha256

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

WAIT_S = 60
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def call(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    """(status, decoded JSON or bytes) of one request to the local server."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"content-type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            status, raw, kind = answer.status, answer.read(), answer.headers.get("content-type", "")
    except urllib.error.HTTPError as err:
        status, raw, kind = err.code, err.read(), err.headers.get("content-type", "")
    return status, json.loads(raw) if kind.startswith("application/json") else raw


@contextlib.contextmanager
def served(service) -> Iterator[str]:
    """`service`'s app on 127.0.0.1 and a free port, in a thread; its URL. Stopped on exit (bounded)."""
    from mmgen.serve.app import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        sock.close()


def test_every_route_but_health_is_503_until_loaded(tmp_path: Path, default_model_dir: Path) -> None:
    from mmgen.serve.cli import pipeline_loader, register
    from mmgen.serve.service import ServeSettings, Service

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", str(default_model_dir), "--device", "cpu"])
    load_model = pipeline_loader(args)  # what `mmgen serve` loads with
    release, loading = threading.Event(), threading.Event()

    def load():
        assert release.wait(WAIT_S), "the test never let the model load"
        loading.set()
        return load_model()

    service = Service(ServeSettings(state=tmp_path / "state"), default_model_dir.name, load)
    with served(service) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        assert call("GET", url + "/health") == (503, {"status": "loading"})
        with pytest.raises(openai.APIStatusError) as caught:
            client.models.list()
        assert caught.value.status_code == 503 and caught.value.response.headers["retry-after"]
        some_id = "video_" + "0" * 32
        for method, path in [
            ("GET", "/v1/videos"),
            ("GET", f"/v1/videos/{some_id}"),
            ("GET", f"/v1/videos/{some_id}/content"),
            ("DELETE", f"/v1/videos/{some_id}"),
            ("GET", "/v1/images/img_" + "0" * 32 + "/content"),
        ]:
            assert call(method, url + path)[0] == 503, path
        assert call("GET", url + "/metrics")[0] == 200

        # What the request alone refuses is a 400 now, naming the field sent; no weights are read.
        with warnings.catch_warnings(), pytest.raises(openai.BadRequestError) as refused:
            warnings.simplefilter("ignore", DeprecationWarning)
            client.videos.create(prompt=PROMPT, size="47x48")
        error = refused.value.body if isinstance(refused.value.body, dict) else {}
        assert error.get("error", error).get("param") == "size", refused.value.body
        for route, body, param in [
            ("/v1/videos", {"prompt": PROMPT, "size": "48x8208"}, "size"),
            ("/v1/videos", {"prompt": PROMPT, "size": "2064x2048"}, "size"),
            ("/v1/videos", {"prompt": PROMPT, "size": "1280x720", "num_frames": 133}, "num_frames"),
            ("/v1/videos", {"prompt": PROMPT, "num_inference_steps": 0}, "num_inference_steps"),
            ("/v1/videos", {"prompt": PROMPT, "model": "sora-2"}, "model"),
            ("/v1/images/generations", {"prompt": PROMPT, "size": "48x40"}, "size"),
            ("/v1/images/generations", {"size": "48x48"}, "prompt"),
        ]:
            status, answer = call("POST", url + route, body)
            assert status == 400 and answer["error"]["param"] == param, answer
        status, answer = call("POST", url + "/v1/videos", {"prompt": PROMPT, **FAST})
        assert status == 503 and "loading" in answer["error"]["message"], answer
        assert not loading.is_set() and service.store.counts()["queued"] == 0

        release.set()
        deadline = time.monotonic() + WAIT_S
        while True:  # the client's readiness poll
            try:
                assert client.models.list().data[0].id == default_model_dir.name
                break
            except openai.APIStatusError as err:
                assert err.status_code == 503 and time.monotonic() < deadline, err
                time.sleep(0.05)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            video = client.videos.create(
                prompt=PROMPT, size="48x48", extra_body={"num_frames": 9, "num_inference_steps": 2, "seed": 7}
            )
            while video.status in ("queued", "in_progress"):
                assert time.monotonic() < deadline + WAIT_S, video
                time.sleep(0.05)
                video = client.videos.retrieve(video.id)
        assert video.status == "completed", video
        frames = call("GET", f"{url}/v1/videos/{video.id}")[1]["frames_sha256"]
    assert frames == reference_frames_sha256(default_model_dir, 7)
