"""`mmgen serve --model QWEN21_DIR` live: a tiny random Qwen-Image-2.1 directory served on loopback.

Through the official `openai` client, POST /v1/images/generations answers an RGBA PNG whose bytes are
the file `mmgen generate --model QWEN21_DIR` writes for the same seed, size and steps.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
from pathlib import Path

import numpy as np
import pytest
from serve_cases import ServerProcess

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

KEY = "q21-key-" + "z" * 24
PROMPT = "a kite over a lake"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qwen_image21_pipeline_cases import tiny_parts, write_qwen_image21_dir

    root = tmp_path_factory.mktemp("q21dir")
    return write_qwen_image21_dir(root, tiny_parts(root), None)


def test_openai_client_image_is_mmgen_generate(model_dir: Path, tmp_path: Path) -> None:
    from PIL import Image

    from mmgen.cli import main

    with ServerProcess(tmp_path / "state", model_dir, api_key=KEY) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        answer = client.images.generate(
            prompt=PROMPT,
            size="96x64",
            response_format="b64_json",
            extra_body={"num_inference_steps": 2, "seed": 4},
        )
    served = base64.b64decode(answer.data[0].b64_json)
    out = tmp_path / "kite.png"
    argv = [
        "generate",
        PROMPT,
        "--model",
        str(model_dir),
        "--device",
        "cpu",
        "--width",
        "96",
        "--height",
        "64",
    ]
    argv += ["--steps", "2", "--seed", "4", "--out", str(out), "--no-progress"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    assert hashlib.sha256(served).hexdigest() == hashlib.sha256(out.read_bytes()).hexdigest()
    pixels = np.asarray(Image.open(io.BytesIO(served)))
    assert pixels.shape == (64, 96, 4)
