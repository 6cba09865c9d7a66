"""`mmgen serve` live, through the official `openai` client and plain HTTP, on the default model.

One server subprocess (loopback, an ephemeral port, an API key) serves the whole module. A served
job's frames_sha256 equals `mmgen generate`'s for the same request; bad requests are 4xx naming the
field; a cancelled running job stops between steps and publishes nothing.
"""

from __future__ import annotations

import base64
import io
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
from serve_cases import FAST, PROMPT, ServerProcess, chromium, reference_frames_sha256, refused_edit
from test_request_bounds import png_claiming

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

KEY = "test-key-" + "x" * 24
MAX_QUEUE = 4
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path):
    state = tmp_path_factory.mktemp("serve") / "state"
    with ServerProcess(state, default_model_dir, "--max-queue", str(MAX_QUEUE), api_key=KEY) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_openai_client_video_matches_generate(server, client, default_model_dir: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        video = client.videos.create_and_poll(
            prompt=PROMPT,
            size=FAST["size"],
            extra_body={"num_frames": 9, "num_inference_steps": 2, "seed": 7},
            poll_interval_ms=100,
        )
        assert video.status == "completed", video
        assert video.progress == 100 and video.size == "48x48" and video.seconds == "1"
        content = client.videos.download_content(video.id)
    data = content.read()
    assert data[4:8] == b"ftyp"  # an mp4
    job = server.request("GET", f"/v1/videos/{video.id}")[1]
    assert job["frames_sha256"] == reference_frames_sha256(default_model_dir, 7)
    assert job["request"]["seed"] == 7 and job["request"]["num_frames"] == 9
    import hashlib

    assert job["output_sha256"] == hashlib.sha256(data).hexdigest()


def test_openai_client_image_b64(server, client) -> None:
    from PIL import Image

    answer = client.images.generate(
        prompt=PROMPT,
        size="48x48",
        response_format="b64_json",
        extra_body={"num_inference_steps": 2, "seed": 3},
    )
    assert len(answer.data) == 1
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json))))
    assert image.shape == (48, 48, 3)
    body = {"prompt": PROMPT, "size": "48x48", "n": 2, "response_format": "url", "num_inference_steps": 1}
    status, answer = server.request("POST", "/v1/images/generations", body)
    assert status == 200 and len(answer["data"]) == 2, answer
    for item in answer["data"]:
        assert item["url"].startswith(server.url + "/v1/images/img_")
        png = server.request("GET", item["url"].removeprefix(server.url))[1]
        assert np.asarray(Image.open(io.BytesIO(png))).shape == (48, 48, 3)


def test_n_images_from_the_largest_seed_stay_in_the_seed_range(server) -> None:
    """n images take seeds seed, seed + 1, ...: from the largest seed the next is 0, not 2**63 (a seed
    the request refuses, so the second job failed)."""
    body = {"prompt": PROMPT, "size": "48x48", "n": 2, "seed": 2**63 - 1, "num_inference_steps": 1}
    status, answer = server.request("POST", "/v1/images/generations", {**body, "response_format": "url"})
    assert status == 200 and len(answer["data"]) == 2, answer
    first = server.request("POST", "/v1/images/generations", {**body, "n": 1, "seed": 0})[1]["data"][0]
    second = server.request("GET", answer["data"][1]["url"].removeprefix(server.url))[1]
    assert base64.b64decode(first["b64_json"]) == second  # seed 0's image


def test_input_reference_upload(server, client, tmp_path: Path) -> None:
    """An uploaded image becomes the request's `image`; the default model is text-to-video only, so
    the POST is a 400 naming input_reference with the pipeline's own message (no job, no stored
    upload), never a failed job, a 500 or a crash."""
    from PIL import Image

    png = tmp_path / "in.png"
    Image.fromarray(np.full((48, 48, 3), 200, np.uint8)).save(png)
    uploads = set((server.state / "uploads").iterdir())
    with warnings.catch_warnings(), open(png, "rb") as fh, pytest.raises(openai.BadRequestError) as caught:
        warnings.simplefilter("ignore", DeprecationWarning)
        client.videos.create(prompt=PROMPT, input_reference=fh, size="48x48", extra_body={"seed": 1})
    error = caught.value.body if isinstance(caught.value.body, dict) else {}
    error = error.get("error", error)
    assert error.get("param") == "input_reference", caught.value.body
    assert "text-to-video only" in error.get("message", ""), caught.value.body
    assert set((server.state / "uploads").iterdir()) == uploads
    status, answer = server.request("POST", "/v1/videos", {"prompt": PROMPT, "input_reference": "x.png"})
    assert status == 400 and answer["error"]["param"] == "input_reference", answer


def test_an_uploaded_image_claiming_too_many_pixels_is_a_400(server, client) -> None:
    """A 100-byte PNG whose header claims 15000x15000 (PIL refuses it on open) or 10000x10000 (PIL
    decodes it, with a warning) is a 400 naming input_reference and the bound, never a 500."""
    uploads = set((server.state / "uploads").iterdir())
    for width in (15000, 10000):
        with warnings.catch_warnings(), pytest.raises(openai.BadRequestError) as caught:
            warnings.simplefilter("ignore", DeprecationWarning)
            client.videos.create(prompt=PROMPT, input_reference=("in.png", png_claiming(width, width)))
        error = caught.value.body if isinstance(caught.value.body, dict) else {}
        error = error.get("error", error)
        assert error.get("param") == "input_reference", caught.value.body
        assert "an input image is at most 8192 pixels a side" in error.get("message", ""), caught.value.body
    assert set((server.state / "uploads").iterdir()) == uploads


def test_uploads_are_bounded_in_count_and_bytes(server) -> None:
    """A file field takes at most its count of files (400) and a file at most --max-upload bytes (413,
    16 MiB by default), naming the field; nothing is stored."""
    requests = pytest.importorskip("requests")
    png = png_claiming(16, 16)
    uploads = set((server.state / "uploads").iterdir())
    cases = [
        ([("input_reference", ("a.png", png))] * 2, 400, "input_reference", "at most 1 file(s)"),
        ([("reference_images", (f"{i}.png", png)) for i in range(9)], 400, "reference_images", "at most 8"),
        (
            [("input_reference", ("a.png", png + bytes(16 << 20)))],
            413,
            "input_reference",
            "larger than 16777216",
        ),
    ]
    for files, status, param, text in cases:
        answer = requests.post(
            server.url + "/v1/videos",
            data={"prompt": PROMPT},
            files=files,
            headers={"authorization": f"Bearer {KEY}"},
            timeout=60,
        )
        error = answer.json()["error"]
        assert answer.status_code == status and error["param"] == param and text in error["message"], error
    assert set((server.state / "uploads").iterdir()) == uploads


# (body, the field the 400 must name)
BAD_VIDEOS = [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": "x", "num_frames": 7}, "num_frames"),
    ({"prompt": "x", "num_frames": "9"}, "num_frames"),
    ({"prompt": "x", "num_frames": 1.5}, "num_frames"),
    ({"prompt": "x", "height": 50}, "height"),
    ({"prompt": "x", "width": -16}, "width"),
    ({"prompt": "x", "height": 100000}, "height"),
    ({"prompt": "x", "size": "48"}, "size"),
    ({"prompt": "x", "size": "48x48x48"}, "size"),
    ({"prompt": "x", "size": "0x48"}, "size"),
    ({"prompt": "x", "size": "48x48", "height": 64}, "size"),
    ({"prompt": "x", "size": "47x48"}, "size"),  # width 47 is not a multiple of 16: the client sent size
    ({"prompt": "x", "size": "48x8208"}, "size"),  # height over its bound
    ({"prompt": "x", "seconds": "0.3"}, "seconds"),
    ({"prompt": "x", "seconds": "-1"}, "seconds"),
    ({"prompt": "x", "seconds": "soon"}, "seconds"),
    ({"prompt": "x", "seconds": "1", "num_frames": 5}, "seconds"),
    ({"prompt": "x", "fps": 0}, "fps"),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
    ({"prompt": "x", "guidance_scale": -1}, "guidance_scale"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "attention_backend": "magic"}, "attention_backend"),
    ({"prompt": "x", "offload": "disk"}, "offload"),
    ({"prompt": "x", "decode": "fast"}, "decode"),
    ({"prompt": "x", "preset": "nope"}, "preset"),
    ({"prompt": "x", "step_cache": -0.5}, "step_cache"),
    ({"prompt": "x", "cfg_truncation": 2}, "cfg_truncation"),
    ({"prompt": "x", "lora_mode": "sideways"}, "lora_mode"),
    ({"prompt": "x", "model": "sora-2"}, "model"),
    ({"prompt": "x", "colour": "red"}, "colour"),
    ({"prompt": "x", "image": "/etc/passwd"}, "image"),
    ({"prompt": "x", "lora": "/etc/passwd"}, "lora"),
    ({"prompt": "x", "loras": ["../../x.safetensors"]}, "lora"),
    ({"prompt": "x", "max_sequence_length": 1}, "max_sequence_length"),
    ({"prompt": "x", "lora": [{"path": 3}]}, "lora"),
    ({"prompt": "x", "seconds": "1e9"}, "seconds"),
    ({"prompt": "x", "size": "1280x720", "num_frames": 4001}, "num_frames"),
    # values that cost memory or time without a bound (issue 37), and a blank prompt
    ({"prompt": "x", "num_inference_steps": 1000000000}, "num_inference_steps"),
    ({"prompt": "x", "max_sequence_length": 1000000}, "max_sequence_length"),
    ({"prompt": "x" * 16385}, "prompt"),
    ({"prompt": "x", "negative_prompt": "x" * 16385}, "negative_prompt"),
    ({"prompt": " \n\t "}, "prompt"),
    ({"prompt": "x", "seed": 2**63}, "seed"),
    # the request's own pixel bounds (pipelines.checks): a frame, then frames x height x width
    ({"prompt": "x", "size": "2064x2048"}, "size"),
    ({"prompt": "x", "size": "1280x720", "num_frames": 133}, "num_frames"),
    ({"prompt": "x", "preset": "distill-4step", "num_inference_steps": 3}, "num_inference_steps"),
    ({"prompt": "x", "input_reference": "x.png"}, "input_reference"),
    # the loaded model's own checks, at POST time: one expert, text-to-video only
    ({"prompt": "x", "guidance_scale_2": 3.0}, "guidance_scale_2"),
]


def test_bad_requests_are_400_naming_the_field(server) -> None:
    for body, field in BAD_VIDEOS:
        status, answer = server.request("POST", "/v1/videos", body)
        assert status == 400, (body, status, answer)
        assert answer["error"]["param"] == field, (body, answer)
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]
    for body, field in [
        ({"prompt": "x", "n": 9}, "n"),
        ({"prompt": "x", "response_format": "gif"}, "response_format"),
        ({"prompt": "x", "num_frames": 9}, "num_frames"),
        ({"prompt": "x", "size": "47x48"}, "size"),
        ({"prompt": "x", "size": "2048x2064"}, "size"),
    ]:
        status, answer = server.request("POST", "/v1/images/generations", body)
        assert status == 400 and answer["error"]["param"] == field, (body, answer)
    assert server.request("POST", "/v1/videos", b"{not json")[0] == 400
    assert server.request("POST", "/v1/videos", [1, 2])[0] == 400
    assert server.request("GET", "/v1/videos?limit=0")[1]["error"]["param"] == "limit"
    assert server.request("GET", "/v1/videos?order=up")[1]["error"]["param"] == "order"


def test_images_edits_on_a_video_model_is_a_400_naming_model(server, client, tmp_path: Path) -> None:
    from PIL import Image

    png = tmp_path / "in.png"
    Image.fromarray(np.full((32, 48, 3), 90, np.uint8)).save(png)
    error = refused_edit(server, client, png)
    assert error.get("param") == "model", error
    assert "does not edit images" in error["message"] and "use POST /v1/videos" in error["message"]


def test_form_fields_are_coerced_by_the_request_types(server) -> None:
    """What the openai client sends (multipart; extra_body as form fields), here with a bad value."""
    boundary = "b0undary"
    parts = [("prompt", PROMPT), ("size", "48x48"), ("num_inference_steps", "two")]
    body = "".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
        for name, value in parts
    )
    body += f"--{boundary}--\r\n"
    headers = {"content-type": f"multipart/form-data; boundary={boundary}"}
    status, answer = server.request("POST", "/v1/videos", body.encode(), headers=headers)
    assert status == 400 and answer["error"]["param"] == "num_inference_steps", answer


def test_auth_ids_and_routes(server) -> None:
    assert server.request("GET", "/health", key=None)[0] == 200
    for method, path in [
        ("GET", "/v1/videos"),
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("POST", "/v1/videos"),
    ]:
        status, answer = server.request(method, path, {"prompt": "x"}, key=None)
        assert status == 401, (path, answer)
        assert server.request(method, path, {"prompt": "x"}, key="wrong")[0] == 401
    for bad in ["video_../../etc/passwd", "..%2F..%2Fjobs.sqlite3", "video_" + "0" * 32, "img_" + "a" * 32]:
        assert server.request("GET", f"/v1/videos/{bad}")[0] == 404, bad
        assert server.request("GET", f"/v1/videos/{bad}/content")[0] == 404, bad
        assert server.request("DELETE", f"/v1/videos/{bad}")[0] == 404, bad
    models = server.request("GET", "/v1/models")[1]
    assert models["data"][0]["id"] == "wan-tiny-v4"
    metrics = server.request("GET", "/metrics")[1].decode()
    for name in ("mmgen_queue_depth", "mmgen_jobs{", "mmgen_step_seconds_bucket", "mmgen_job_seconds"):
        assert name in metrics, name


def test_cancel_running_job_publishes_nothing(server, client) -> None:
    status, job = server.request("POST", "/v1/videos", {"prompt": PROMPT, **FAST, "num_inference_steps": 200})
    assert status == 200 and job["status"] == "queued"
    queued = server.request("POST", "/v1/videos", {"prompt": PROMPT, **FAST, "seed": 1})[1]
    running = server.wait_for(job["id"], ("in_progress",))
    import time

    deadline = time.monotonic() + 60
    while running["progress"] < 2:  # at least one denoising step done
        assert time.monotonic() < deadline
        time.sleep(0.02)
        running = server.request("GET", f"/v1/videos/{job['id']}")[1]
    assert server.request("GET", f"/v1/videos/{job['id']}/content")[0] == 409
    assert server.request("DELETE", f"/v1/videos/{queued['id']}")[0] == 200  # still queued behind it
    assert server.request("GET", f"/v1/videos/{queued['id']}")[1]["status"] == "cancelled"
    deleted = client.videos.delete(job["id"])  # a running job is cancelled, not deleted
    assert not deleted.deleted and deleted.id == job["id"]
    steps_at_cancel = _steps_done(server)
    ended = server.wait_for(job["id"], ("cancelled", "completed", "failed"), timeout=60)
    assert ended["status"] == "cancelled" and ended["progress"] < 90, ended
    # It stops within one step: at most the step in flight when the cancel was recorded finishes.
    assert _steps_done(server) - steps_at_cancel <= 1
    assert "frames_sha256" not in ended
    assert server.request("GET", f"/v1/videos/{job['id']}/content")[0] == 409
    outputs = server.state / "outputs"
    assert not [p.name for p in outputs.iterdir() if job["id"] in p.name or queued["id"] in p.name]


def _steps_done(server: ServerProcess) -> float:
    """Denoising steps the server has run (its step-latency histogram's count)."""
    text = server.request("GET", "/metrics")[1].decode()
    return float(
        next(line.split()[1] for line in text.splitlines() if line.startswith("mmgen_step_seconds_count"))
    )


def test_list_pages(server) -> None:
    ids = [
        server.request("POST", "/v1/videos", {"prompt": PROMPT, **FAST, "seed": s})[1]["id"]
        for s in (11, 12, 13)
    ]
    page = server.request("GET", "/v1/videos?limit=2&order=desc")[1]
    assert [v["id"] for v in page["data"]] == ids[::-1][:2] and page["has_more"]
    rest = server.request("GET", f"/v1/videos?limit=2&order=desc&after={page['last_id']}")[1]
    assert rest["data"][0]["id"] == ids[0]
    asc = server.request("GET", f"/v1/videos?order=asc&after={ids[0]}")[1]
    assert [v["id"] for v in asc["data"]] == ids[1:]
    for video_id in ids:  # leave the worker idle for the next module
        server.request("DELETE", f"/v1/videos/{video_id}")


def test_queue_and_body_bounds(server) -> None:
    import http.client
    import urllib.parse

    slow = {"prompt": PROMPT, **FAST, "num_inference_steps": 200}
    server.wait_idle()  # jobs an earlier test cancelled may still be stopping
    ids = []
    for _ in range(MAX_QUEUE):
        status, job = server.request("POST", "/v1/videos", slow)
        assert status == 200, job
        ids.append(job["id"])
    url = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.request(
            "POST",
            "/v1/videos",
            body=b'{"prompt": "x"}',
            headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
        )
        full = conn.getresponse()
        assert full.status == 429 and full.getheader("retry-after"), full.status
        full.read()
        conn.putrequest("POST", "/v1/videos")  # a body too large is refused before it is read
        conn.putheader("authorization", f"Bearer {KEY}")
        conn.putheader("content-length", str(1 << 40))
        conn.endheaders()
        assert conn.getresponse().status == 413
    finally:
        conn.close()
        for video_id in ids:
            server.request("DELETE", f"/v1/videos/{video_id}")
    for video_id in ids:
        assert server.wait_for(video_id, ("cancelled",), timeout=60)["status"] == "cancelled"


def test_json_bodies_are_bounded(server, client) -> None:
    """Deep nesting, a key given twice and a 10 MB prompt are refused before anything is queued; no
    route then shows more than the bounded body held."""
    deep = b"[" * 50_000 + b"]" * 50_000
    status, answer = server.request("POST", "/v1/videos", deep)
    assert status == 400 and "nested deeper than" in answer["error"]["message"], (status, answer)
    nested = b'{"prompt": "x", "lora": ' + b"[" * 20 + b"]" * 20 + b"}"
    status, answer = server.request("POST", "/v1/videos", nested)
    assert status == 400 and "nested deeper than" in answer["error"]["message"], (status, answer)
    twice = b'{"prompt": "x", "seed": 1, "size": "48x48", "seed": 2}'
    for path in ("/v1/videos", "/v1/images/generations"):
        status, answer = server.request("POST", path, twice)
        assert status == 400 and answer["error"]["param"] == "seed", (status, answer)
        assert "given twice" in answer["error"]["message"], answer
    huge = {"prompt": "x" * (10 << 20), **FAST}
    status, answer = server.request("POST", "/v1/videos", huge)
    assert status == 413, (status, answer)
    assert "JSON body of" in answer["error"]["message"] and "at most" in answer["error"]["message"]
    with warnings.catch_warnings(), pytest.raises(openai.APIStatusError) as caught:  # a multipart form
        warnings.simplefilter("ignore", DeprecationWarning)
        client.videos.create(prompt="x" * (10 << 20), size="48x48")
    assert caught.value.status_code == 413, caught.value.body
    # A list shows each job's prompt once (its recorded request is GET /v1/videos/{id}'s).
    long = PROMPT + "," + " red" * 3000
    job = server.request("POST", "/v1/videos", {"prompt": long, **FAST, "num_inference_steps": 1})[1]
    server.wait_for(job["id"], ("completed",))
    assert server.request("GET", f"/v1/videos/{job['id']}")[1]["request"]["prompt"] == long
    listed = server.request("GET", "/v1/videos?limit=1")[1]["data"][0]
    assert listed["id"] == job["id"] and listed["prompt"] == long and listed.get("request") is None
    assert len(json.dumps(listed)) < len(long) + 4096


def test_reference_images_on_a_model_without_them(server) -> None:
    """The default model takes no reference images: the 400 says so, not that the server lacks --input-dir."""
    status, answer = server.request("POST", "/v1/videos", {"prompt": "x", "reference_images": ["a.png"]})
    assert status == 400 and answer["error"]["param"] == "reference_images", answer
    message = answer["error"]["message"]
    assert "takes no reference_images" in message and "--input-dir" not in message, message


def test_auth_scheme_is_case_insensitive(server) -> None:
    for header, expected in [
        (f"bearer {KEY}", 200),
        (f"BEARER {KEY}", 200),
        (f"Bearer  {KEY} ", 200),
        (f"Basic {KEY}", 401),
        (f"bearer {KEY}x", 401),
        ("bearer", 401),
    ]:
        status, _ = server.request("GET", "/v1/models", key=None, headers={"authorization": header})
        assert status == expected, header


def _cancelled_count(server: ServerProcess) -> float:
    text = server.request("GET", "/metrics")[1].decode()
    found = [
        line
        for line in text.splitlines()
        if line.startswith('mmgen_jobs_finished_total{outcome="cancelled"}')
    ]
    return float(found[0].split()[1]) if found else 0.0


def test_delete_cancels_unfinished_and_deletes_finished(server, client) -> None:
    """DELETE of a queued or running job cancels it and answers deleted: false (GET shows it cancelled);
    DELETE of a finished job deletes it (deleted: true; GET is a 404, its output gone). Every cancel is
    counted in mmgen_jobs_finished_total."""
    server.wait_idle()
    done = server.request("POST", "/v1/videos", {"prompt": PROMPT, **FAST, "seed": 3})[1]
    slow = server.request("POST", "/v1/videos", {"prompt": PROMPT, **FAST, "num_inference_steps": 200})[1]
    queued = server.request("POST", "/v1/videos", {"prompt": PROMPT, **FAST, "seed": 4})[1]
    server.wait_for(slow["id"], ("in_progress",))
    counted = _cancelled_count(server)
    status, answer = server.request("DELETE", f"/v1/videos/{queued['id']}")
    assert status == 200 and answer == {"id": queued["id"], "object": "video.deleted", "deleted": False}
    assert server.request("GET", f"/v1/videos/{queued['id']}")[1]["status"] == "cancelled"
    assert _cancelled_count(server) == counted + 1  # a queued job ended by the cancel
    assert client.videos.delete(slow["id"]).deleted is False
    assert server.wait_for(slow["id"], ("cancelled", "completed", "failed"))["status"] == "cancelled"
    server.wait_idle()
    assert _cancelled_count(server) == counted + 2
    for job in (done, slow, queued):  # finished now: deleted
        ended = server.wait_for(job["id"], ("completed", "cancelled", "failed"))
        output = server.state / "outputs" / f"{job['id']}.mp4"
        assert output.is_file() == (ended["status"] == "completed")
        assert client.videos.delete(job["id"]).deleted is True
        assert server.request("GET", f"/v1/videos/{job['id']}")[0] == 404
        assert not output.exists()
    assert _cancelled_count(server) == counted + 2


def test_web_page_in_chromium(server, default_model_dir: Path, tmp_path: Path) -> None:
    """The page at /: submit a prompt, watch its bar reach 100%, play the video (its sha256 shown is
    `mmgen generate`'s), cancel a second job. Debian's chromium + chromium-driver (.ci/run installs them)."""
    driver = chromium()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, 90, poll_frequency=0.1)
    try:
        driver.get(server.url + "/")
        driver.find_element(By.ID, "key").send_keys(KEY)

        def submit(steps: int, seed: int) -> str:
            newest = server.request("GET", "/v1/videos?limit=1")[1]["data"]
            for name, value in (("prompt", PROMPT), ("size", "48x48"), ("num_frames", "9")):
                field = driver.find_element(By.ID, name)
                field.clear()
                field.send_keys(value)
            for name, value in (("num_inference_steps", steps), ("seed", seed)):
                field = driver.find_element(By.ID, name)
                field.clear()
                field.send_keys(str(value))
            driver.find_element(By.ID, "submit").click()
            old = newest[0]["id"] if newest else None
            wait.until(lambda _: server.request("GET", "/v1/videos?limit=1")[1]["data"][0]["id"] != old)
            return server.request("GET", "/v1/videos?limit=1")[1]["data"][0]["id"]

        done = submit(2, 7)
        row = f"document.getElementById('{done}')"
        wait.until(lambda d: d.execute_script(f"return {row} && {row}.dataset.progress") == "100")
        assert driver.execute_script(f"return {row}.dataset.status") == "completed"
        driver.find_element(By.CSS_SELECTOR, f"tr[id='{done}'] button.play").click()
        wait.until(
            lambda d: d.execute_script(
                "const v = document.getElementById('video'); return v.readyState >= 2 || v.error !== null"
            )
        )
        video = driver.execute_script(
            "const v = document.getElementById('video'); return [v.error && v.error.code, v.duration, v.videoWidth]"
        )
        assert video[0] is None and video[1] > 0 and video[2] == 48, video
        assert driver.find_element(By.ID, "sha").text == reference_frames_sha256(default_model_dir, 7)

        running = submit(200, 9)
        server.wait_for(running, ("in_progress",))
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"tr[id='{running}'] button.cancel"))
        driver.find_element(By.CSS_SELECTOR, f"tr[id='{running}'] button.cancel").click()
        assert (
            server.wait_for(running, ("cancelled", "completed", "failed"), timeout=60)["status"]
            == "cancelled"
        )
        wait.until(
            lambda d: (
                d.execute_script(f"return document.getElementById('{running}').dataset.status") == "cancelled"
            )
        )
        driver.save_screenshot(os.environ.get("MMGEN_SERVE_SCREENSHOT") or str(tmp_path / "page.png"))
    finally:
        driver.quit()
