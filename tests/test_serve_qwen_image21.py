"""`mmgen serve --model QWEN21_DIR` live: a tiny random Qwen-Image-2.1 directory served on loopback.

Through the official `openai` client, POST /v1/images/generations answers an RGBA PNG whose bytes are
the file `mmgen generate --model QWEN21_DIR` writes for the same seed, size and steps; POST
/v1/images/edits with one or several uploaded images (an RGBA PNG among them, its alpha kept) answers
the PNG `mmgen generate --image A --image B` writes; the page at / offers several condition images and
its edit is the same PNG again. More images than a request takes is a 400 naming `image`.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from serve_cases import ServerProcess, chromium, page_image_sha256

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

KEY = "q21-key-" + "z" * 24
# The tiny processor reads images of at most 96 x 96 pixels: condition images at about 64 x 64.
RESOLUTION = "64"
PROMPT = "a kite over a lake"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qwen_image21_pipeline_cases import tiny_parts, write_qwen_image21_dir

    root = tmp_path_factory.mktemp("q21dir")
    return write_qwen_image21_dir(root, tiny_parts(root), None)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path):
    with ServerProcess(tmp_path_factory.mktemp("serve-q21") / "state", model_dir, api_key=KEY) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def pngs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two condition images: an RGB 60 x 40 PNG and an RGBA 40 x 56 PNG (a varying alpha)."""
    from PIL import Image

    folder, state = tmp_path_factory.mktemp("inputs"), np.random.RandomState(7)
    first, second = folder / "first.png", folder / "second.png"
    Image.fromarray((state.rand(40, 60, 3) * 255).astype(np.uint8)).save(first)
    Image.fromarray((state.rand(56, 40, 4) * 255).astype(np.uint8), mode="RGBA").save(second)
    return first, second


def generate(model_dir: Path, out: Path, *extra: str) -> bytes:
    """The PNG `mmgen generate --model QWEN21_DIR` writes, 2 steps, seed 4, `extra` flags."""
    from mmgen.cli import main

    argv = ["generate", PROMPT, "--model", str(model_dir), "--device", "cpu", *extra]
    argv += ["--steps", "2", "--seed", "4", "--out", str(out), "--no-progress"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    return out.read_bytes()


def test_openai_client_image_is_mmgen_generate(client, model_dir: Path, tmp_path: Path) -> None:
    from PIL import Image

    answer = client.images.generate(
        prompt=PROMPT,
        size="96x64",
        response_format="b64_json",
        extra_body={"num_inference_steps": 2, "seed": 4},
    )
    served = base64.b64decode(answer.data[0].b64_json)
    expected = generate(model_dir, tmp_path / "kite.png", "--width", "96", "--height", "64")
    assert hashlib.sha256(served).hexdigest() == hashlib.sha256(expected).hexdigest()
    pixels = np.asarray(Image.open(io.BytesIO(served)))
    assert pixels.shape == (64, 96, 4)


@pytest.mark.parametrize("count", [1, 2])
def test_openai_client_edit_is_mmgen_generate_with_the_images(
    client, model_dir: Path, pngs, tmp_path: Path, count: int
) -> None:
    """images.edit with one image, or a list of two (sent as `image[]`, in order; the second RGBA):
    the PNG is `mmgen generate --image A [--image B]`'s, its size the last image's aspect ratio."""
    from PIL import Image

    with contextlib.ExitStack() as files:
        opened = [files.enter_context(open(path, "rb")) for path in pngs[:count]]
        answer = client.images.edit(
            image=opened[0] if count == 1 else opened,
            prompt=PROMPT,
            response_format="b64_json",
            extra_body={"num_inference_steps": 2, "seed": 4, "output_resolution": int(RESOLUTION)},
        )
    served = base64.b64decode(answer.data[0].b64_json)
    flags = [item for path in pngs[:count] for item in ("--image", str(path))]
    expected = generate(model_dir, tmp_path / "edit.png", *flags, "--output-resolution", RESOLUTION)
    assert hashlib.sha256(served).hexdigest() == hashlib.sha256(expected).hexdigest()
    assert Image.open(io.BytesIO(served)).mode == "RGBA"


def test_too_many_images_is_a_400_naming_image(client, pngs) -> None:
    with contextlib.ExitStack() as files:
        opened = [files.enter_context(open(pngs[0], "rb")) for _ in range(5)]
        with pytest.raises(openai.BadRequestError) as caught:
            client.images.edit(image=opened, prompt=PROMPT)
    error = caught.value.body if isinstance(caught.value.body, dict) else {}
    error = error.get("error", error)
    assert error.get("param") == "image" and "at most 4 file" in error["message"], caught.value.body


def test_web_page_edits_with_two_condition_images(server, model_dir: Path, pngs, tmp_path: Path) -> None:
    """The page at / on a 2.1 model (capabilities: several_images) takes several files as `image` and
    sends them to /v1/images/edits in the order chosen: the PNG it shows is `mmgen generate`'s."""
    fields = {"prompt": PROMPT, "num_inference_steps": "2", "seed": "4", "output_resolution": RESOLUTION}
    fields["upload-image"] = "\n".join(str(path) for path in pngs)  # a `multiple` input: one path a line
    shown = page_image_sha256(
        server,
        fields,
        ready=lambda d: d.execute_script("return document.getElementById('upload-image')?.multiple === true"),
    )
    flags = ("--image", str(pngs[0]), "--image", str(pngs[1]), "--output-resolution", RESOLUTION)
    expected = generate(model_dir, tmp_path / "page.png", *flags)
    assert shown == hashlib.sha256(expected).hexdigest()


# Every body the page POSTs, kept in the page (window.sent) as the page hands it to fetch.
RECORD_BODIES = """
window.sent = [];
const send = window.fetch;
window.fetch = (path, init) => {
  if (init && init.method === "POST") window.sent.push(init.body);
  return send(path, init);
};
"""


def test_web_page_sends_no_prefix_cache_only_when_checked(server, model_dir: Path, tmp_path: Path) -> None:
    """The page's "no prefix cache" box shows on a 2.1 model (GET /health's capabilities.fields has
    no_prefix_cache): unchecked, the body it posts has no such field; checked, no_prefix_cache is true
    and the PNG it shows is `mmgen generate --no-prefix-cache`'s."""
    driver = chromium()
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, 90, poll_frequency=0.1)

    def submit() -> tuple[dict, str]:
        driver.execute_script("document.getElementById('sha').textContent = ''")
        driver.find_element(By.ID, "submit").click()
        try:
            wait.until(lambda d: d.find_element(By.ID, "sha").text or d.find_element(By.ID, "error").text)
        except TimeoutException:  # seen once in a full suite run (not reproduced): say what the sides saw
            button = driver.find_element(By.ID, "submit")
            raise AssertionError(
                f"no sha and no error on the page in 90 s; bodies sent {driver.execute_script('return window.sent')}; "
                f"button {button.text!r} disabled={not button.is_enabled()}; "
                f"server log: {server.log.read_text()[-3000:] if server.log.exists() else '(none)'}"
            ) from None
        assert driver.find_element(By.ID, "error").text == ""
        return json.loads(driver.execute_script("return window.sent.at(-1)")), driver.find_element(
            By.ID, "sha"
        ).text

    try:
        driver.get(server.url + "/")
        wait.until(lambda d: d.find_element(By.ID, "no_prefix_cache").is_displayed())
        driver.execute_script(RECORD_BODIES)
        driver.find_element(By.ID, "key").send_keys(server.api_key)
        for name, value in (
            ("prompt", PROMPT),
            ("size", "96x64"),
            ("num_inference_steps", "2"),
            ("seed", "4"),
        ):
            driver.find_element(By.ID, name).send_keys(value)
        cached, _ = submit()
        assert "no_prefix_cache" not in cached and cached["seed"] == 4, cached
        driver.find_element(By.ID, "no_prefix_cache").click()
        uncached, shown = submit()
        assert uncached["no_prefix_cache"] is True, uncached
    finally:
        driver.quit()
    expected = generate(
        model_dir, tmp_path / "uncached.png", "--width", "96", "--height", "64", "--no-prefix-cache"
    )
    assert shown == hashlib.sha256(expected).hexdigest()
