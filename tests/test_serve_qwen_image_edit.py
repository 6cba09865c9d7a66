"""`mmgen serve --model EDIT_DIR` live: POST /v1/images/edits on a tiny random Qwen-Image-Edit directory.

One server subprocess on loopback (CPU, fp32). Through the official `openai` client, an uploaded PNG
edited with a seed and a size comes back as the PNG `mmgen generate --model EDIT_DIR --image the.png`
writes for the same request (b64_json and url); the upload is stored with its job under the state
directory. What is wrong with the image (none, not an image, a path instead of a file, one too many)
or with the body is a 400 naming the field, and stores nothing; /v1/images/generations without an
image is the pipeline's own refusal, a 400 naming `image`. (The edits route on models that do not edit
is a 400 naming `model`: tests/test_serve_qwen_image.py and tests/test_serve_api.py.)
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
from pathlib import Path

import numpy as np
import pytest
from serve_cases import ServerProcess, page_image_sha256

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")
pytest.importorskip("fastapi")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from qwen_image_edit_cases import write_qwen_image_edit_dir  # noqa: E402

from mmgen.serve.queue import valid_job_id  # noqa: E402

KEY = "edit-key-" + "z" * 24
PROMPT = "make the sky blue"
SIZE = "48x32"  # W x H of the edited image
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def edit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen_image_edit_dir(tmp_path_factory.mktemp("qwen-edit"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, edit_dir: Path):
    state = tmp_path_factory.mktemp("serve-qwen-edit") / "state"
    with ServerProcess(state, edit_dir, api_key=KEY) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def png(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The image to edit: a non-square (60 x 40) random PNG."""
    from PIL import Image

    path = tmp_path_factory.mktemp("input") / "the.png"
    Image.fromarray((np.random.RandomState(3).rand(40, 60, 3) * 255).astype(np.uint8)).save(path)
    return path


def generate_edit(edit_dir: Path, image: Path, out: Path, seed: int) -> bytes:
    """The PNG `mmgen generate --model EDIT_DIR --image IMAGE` writes at SIZE, 2 steps, `seed`."""
    from mmgen.cli import main

    width, height = SIZE.split("x")
    argv = ["generate", PROMPT, "--model", str(edit_dir), "--image", str(image), "--device", "cpu"]
    argv += ["--width", width, "--height", height, "--steps", "2", "--seed", str(seed)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main([*argv, "--out", str(out), "--no-progress"]) == 0, printed.getvalue()
    return out.read_bytes()


def post_edit(server: ServerProcess, files: list, **fields: object) -> tuple[int, dict]:
    """POST /v1/images/edits as a multipart form: `files` [(field, (name, bytes, type))], text fields."""
    data = {"prompt": PROMPT, "size": SIZE, **{name: str(value) for name, value in fields.items()}}
    answer = requests.post(
        server.url + "/v1/images/edits",
        data=data,
        files=files or None,
        headers={"authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    return answer.status_code, answer.json()


def uploads_of(server: ServerProcess) -> set[Path]:
    return set((server.state / "uploads").glob("*/*"))


def test_openai_client_edit_is_mmgen_generate(
    server, client, edit_dir: Path, png: Path, tmp_path: Path
) -> None:
    with open(png, "rb") as image:
        answer = client.images.edit(
            image=image,
            prompt=PROMPT,
            size=SIZE,
            response_format="b64_json",
            extra_body={"seed": 4, "num_inference_steps": 2},
        )
    served = base64.b64decode(answer.data[0].b64_json)
    assert served == generate_edit(edit_dir, png, tmp_path / "edited.png", seed=4)
    stored = [path for path in uploads_of(server) if path.read_bytes() == png.read_bytes()]
    assert [path.name for path in stored] == ["image-0.png"], uploads_of(server)
    assert valid_job_id(stored[0].parent.name, "image")  # kept in its job's folder

    # url, n = 2: seeds 4 and 5 on the one uploaded file; the first is the same PNG again
    with open(png, "rb") as image:
        listed = client.images.edit(
            image=image,
            prompt=PROMPT,
            size=SIZE,
            n=2,
            response_format="url",
            extra_body={"seed": 4, "num_inference_steps": 2},
        )
    pngs = [server.request("GET", item.url.removeprefix(server.url))[1] for item in listed.data]
    assert pngs[0] == served and pngs[1] == generate_edit(edit_dir, png, tmp_path / "five.png", seed=5)


def test_generations_without_an_image_is_the_pipelines_400(server) -> None:
    status, answer = server.request("POST", "/v1/images/generations", {"prompt": PROMPT, "size": SIZE})
    assert status == 400 and answer["error"]["param"] == "image", answer
    assert answer["error"]["message"].startswith("image: required by Qwen-Image-Edit"), answer


def _file(field: str, data: bytes, name: str = "x.png") -> tuple[str, tuple[str, bytes, str]]:
    return field, (name, data, "image/png")


@pytest.mark.parametrize(
    ("files", "fields", "param", "text"),
    [
        ([], {}, "image", "image: required: the image to edit"),
        ([_file("image", b"hello, not a picture")], {}, "image", "of no kind this server reads"),
        ([_file("image", b"\x00\x00\x00\x18ftypmp42" + bytes(16))], {}, "image", "the uploaded file is MP4"),
        ([_file("image", b"\x89PNG\r\n\x1a\n" + bytes(20))], {}, "image", "(uploaded image)"),
        ([], {"image": "the.png"}, "image", "send the image to edit as a file"),
        ("two", {}, "image", "at most 1 file"),
        ("mask", {}, "mask", "a file is allowed only as image"),
        ("png", {"n": 9}, "n", "must be an integer in [1, 4]"),
        ("png", {"response_format": "jpeg"}, "response_format", "b64_json, url"),
        ("png", {"size": "48"}, "size", "WIDTHxHEIGHT"),
        ("png", {"num_frames": 5}, "num_frames", "an image is 1 frame"),
        ("png", {"step_cache": 0.1}, "step_cache", "not supported by the Qwen-Image-Edit pipeline"),
        ("png", {"model": "gpt-image-1"}, "model", "this server serves"),
        ("png", {"colour": "red"}, "colour", "unknown field"),
    ],
)
def test_bad_edits_are_400s_naming_the_field(server, png: Path, files, fields, param, text) -> None:
    good = _file("image", png.read_bytes(), png.name)
    if isinstance(files, str):  # the files that need the input PNG
        files = {"two": [good, good], "mask": [good, _file("mask", png.read_bytes())], "png": [good]}[files]
    before = uploads_of(server)
    status, answer = post_edit(server, files, **fields)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert text in answer["error"]["message"], answer
    assert str(server.state) not in answer["error"]["message"]  # the server's paths stay its own
    assert uploads_of(server) == before  # a refused edit stores nothing


def test_openai_client_list_of_images_is_one_field(server, client, png: Path) -> None:
    """The client sends a list of images as `image[]` files: read as `image`, which takes one."""
    before = uploads_of(server)
    with open(png, "rb") as first, open(png, "rb") as second, pytest.raises(openai.BadRequestError) as caught:
        client.images.edit(image=[first, second], prompt=PROMPT, size=SIZE)
    error = caught.value.body if isinstance(caught.value.body, dict) else {}
    error = error.get("error", error)
    assert error.get("param") == "image" and "at most 1 file" in error["message"], caught.value.body
    assert uploads_of(server) == before


def test_web_page_edits_an_image(server, edit_dir: Path, png: Path, tmp_path: Path) -> None:
    """The page at / on an edit model (GET /health lists the `image` upload): the chosen file goes to
    /v1/images/edits, and the PNG the page shows is `mmgen generate --image`'s."""
    fields = {"prompt": PROMPT, "size": SIZE, "num_inference_steps": "2", "seed": "6"}
    shown = page_image_sha256(
        server,
        fields,
        ready=lambda d: d.execute_script("return document.getElementById('upload-image') !== null"),
        files={"upload-image": png},
    )
    assert shown == hashlib.sha256(generate_edit(edit_dir, png, tmp_path / "six.png", seed=6)).hexdigest()
