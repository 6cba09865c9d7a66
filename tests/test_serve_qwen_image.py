"""`mmgen serve --model QWEN_DIR` live: a tiny random Qwen-Image directory served on loopback.

Through the official `openai` client, POST /v1/images/generations answers PNGs (b64_json and url, as
for Wan T2I) whose bytes are the file `mmgen generate --model QWEN_DIR` writes for the same seed,
size and steps; /v1/videos is a 400 naming `model` (an image-only model), and so is /v1/images/edits
(a text-to-image model edits nothing); what only Qwen-Image refuses (a step cache, a Wan preset,
several frames) is a 400 naming the field, never a failed job.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import warnings
from pathlib import Path

import numpy as np
import pytest
from serve_cases import ServerProcess, chromium, page_image_sha256, refused_edit

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

KEY = "qwen-key-" + "y" * 24
PROMPT = "a red cat sits on a green mat"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, qwen_image_dir: Path):
    state = tmp_path_factory.mktemp("serve-qwen") / "state"
    with ServerProcess(state, qwen_image_dir, api_key=KEY) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def generate_png(qwen_image_dir: Path, out: Path, seed: int, *extra: str) -> dict[str, str]:
    """`mmgen generate --model QWEN_DIR` at 48x32 (W x H), 2 steps (and `extra` flags): the printed
    lines, the png at `out`."""
    from mmgen.cli import main

    printed = io.StringIO()
    argv = ["generate", PROMPT, "--model", str(qwen_image_dir), "--device", "cpu", "--width", "48"]
    argv += ["--height", "32", "--steps", "2", "--seed", str(seed), "--out", str(out), "--no-progress"]
    argv += list(extra)
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0, printed.getvalue()
    return dict(line.split(": ", 1) for line in printed.getvalue().splitlines() if ": " in line)


def test_openai_client_image_is_mmgen_generate(server, client, qwen_image_dir: Path, tmp_path: Path) -> None:
    from PIL import Image

    from mmgen.outputs.writers import frames_sha256

    answer = client.images.generate(
        prompt=PROMPT,
        size="48x32",
        response_format="b64_json",
        extra_body={"num_inference_steps": 2, "seed": 4},
    )
    served = base64.b64decode(answer.data[0].b64_json)
    printed = generate_png(qwen_image_dir, tmp_path / "cat.png", seed=4)
    assert (
        hashlib.sha256(served).hexdigest() == hashlib.sha256((tmp_path / "cat.png").read_bytes()).hexdigest()
    )
    pixels = np.asarray(Image.open(io.BytesIO(served)))
    assert pixels.shape == (32, 48, 3)
    assert frames_sha256(pixels[None]) == printed["frames_sha256"]

    # url: n = 2 runs seeds 4 and 5; the first is the same PNG again
    body = {"prompt": PROMPT, "size": "48x32", "n": 2, "response_format": "url", "seed": 4}
    status, listed = server.request("POST", "/v1/images/generations", {**body, "num_inference_steps": 2})
    assert status == 200 and len(listed["data"]) == 2, listed
    pngs = [server.request("GET", item["url"].removeprefix(server.url))[1] for item in listed["data"]]
    assert pngs[0] == served and pngs[1] != served


def test_videos_is_a_400_for_an_image_model(server, client) -> None:
    uploads = set((server.state / "uploads").iterdir())
    with warnings.catch_warnings(), pytest.raises(openai.BadRequestError) as caught:
        warnings.simplefilter("ignore", DeprecationWarning)
        client.videos.create(prompt=PROMPT, size="48x32")
    error = caught.value.body if isinstance(caught.value.body, dict) else {}
    error = error.get("error", error)
    assert error.get("param") == "model", caught.value.body
    assert "makes images only" in error["message"] and "/v1/images/generations" in error["message"]
    assert set((server.state / "uploads").iterdir()) == uploads
    assert server.request("GET", "/v1/videos")[0] == 200  # listing still answers (nothing there)


def test_images_edits_on_a_text_to_image_model_is_a_400_naming_model(server, client, tmp_path: Path) -> None:
    from PIL import Image

    png = tmp_path / "in.png"
    Image.fromarray(np.full((32, 48, 3), 90, np.uint8)).save(png)
    error = refused_edit(server, client, png)
    assert error.get("param") == "model", error
    assert "does not edit images" in error["message"] and "/v1/images/generations" in error["message"]


@pytest.mark.parametrize(
    ("extra", "param", "text"),
    [
        ({"step_cache": 0.1}, "step_cache", "not supported by the Qwen-Image pipeline"),
        ({"preset": "distill-4step"}, "preset", "lightning-8step, lightning-4step"),
        ({"num_frames": 5}, "num_frames", "an image is 1 frame"),
        ({"guidance_scale_2": 3.0}, "guidance_scale_2", "one transformer"),
        ({"max_sequence_length": 2000}, "max_sequence_length", "[2, 1024]"),  # the request value's bound
    ],
)
def test_qwen_refusals_are_400s_naming_the_field(server, extra, param, text) -> None:
    body = {"prompt": PROMPT, "size": "48x32", **extra}  # steps left to the model (a preset fixes them)
    status, answer = server.request("POST", "/v1/images/generations", body)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert text in answer["error"]["message"], answer


def test_web_page_makes_an_image(server, qwen_image_dir: Path, tmp_path: Path) -> None:
    """The page at / on an image model (GET /health says "outputs": "image"): no frames field, no
    video list; a prompt becomes a PNG shown inline, whose sha256 the page prints and which is the
    file `mmgen generate` writes for the same request."""
    driver = chromium()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, 90, poll_frequency=0.1)
    try:
        driver.get(server.url + "/")
        wait.until(lambda d: d.execute_script("return document.body.classList.contains('image-model')"))
        assert not driver.find_element(By.ID, "num_frames").is_displayed()
        assert not driver.find_element(By.ID, "no_prefix_cache").is_displayed()  # Qwen-Image-2.1's field
        driver.find_element(By.ID, "key").send_keys(KEY)
        for name, value in (
            ("prompt", PROMPT),
            ("size", "48x32"),
            ("num_inference_steps", "2"),
            ("seed", "5"),
        ):
            driver.find_element(By.ID, name).send_keys(value)
        driver.find_element(By.ID, "submit").click()
        wait.until(lambda d: d.find_element(By.ID, "sha").text or d.find_element(By.ID, "error").text)
        assert driver.find_element(By.ID, "error").text == ""
        size = driver.execute_script(
            "const p = document.getElementById('picture'); return [p.naturalWidth, p.naturalHeight]"
        )
        assert size == [48, 32]
        generate_png(qwen_image_dir, tmp_path / "cat.png", seed=5)
        assert (
            driver.find_element(By.ID, "sha").text
            == hashlib.sha256((tmp_path / "cat.png").read_bytes()).hexdigest()
        )
        assert driver.find_element(By.ID, "sha-label").text == "png sha256"
    finally:
        driver.quit()


def test_web_page_sends_the_negative_prompt(server, qwen_image_dir: Path, tmp_path: Path) -> None:
    """Qwen-Image's guidance (true CFG) runs only with a negative prompt: the page has the field, and
    its PNG is `mmgen generate --negative-prompt ... --guidance ...`'s (not the unguided one's)."""
    fields = {
        "prompt": PROMPT,
        "negative_prompt": "blurry, dark",
        "size": "48x32",
        "num_inference_steps": "2",
        "seed": "6",
        "guidance_scale": "3",
    }
    image_model = "return document.body.classList.contains('image-model')"
    shown = page_image_sha256(server, fields, ready=lambda d: d.execute_script(image_model))
    guided = tmp_path / "guided.png"
    generate_png(qwen_image_dir, guided, 6, "--negative-prompt", "blurry, dark", "--guidance", "3")
    generate_png(qwen_image_dir, tmp_path / "plain.png", 6, "--guidance", "3")
    assert shown == hashlib.sha256(guided.read_bytes()).hexdigest()
    assert guided.read_bytes() != (tmp_path / "plain.png").read_bytes()
