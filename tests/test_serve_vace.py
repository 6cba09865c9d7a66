"""`mmgen serve` with Wan2.1 VACE inputs uploaded as files of a multipart POST /v1/videos.

One server subprocess on a tiny VACE model directory (CPU, fp32). A job made from uploaded files
(a control video and a mask as MP4, two reference images as PNG) has the frames, latents and MP4
bytes of `mmgen generate` given the same files as paths; the uploads live with the job under the
server's state directory and go with it. Bad uploads are 400s naming the form field, and leave no
file behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from serve_cases import ServerProcess, chromium
from vace_cases import picture, write_vace_dir

pytest.importorskip("fastapi")
requests = pytest.importorskip("requests")

PROMPT = "a red fox running through a snowy forest at sunset"
HEIGHT, WIDTH, FRAMES = 32, 48, 5  # the control video's own size and frames (the request names neither)
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def vace_model(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vace_dir(default_model_dir, tmp_path_factory.mktemp("vace") / "model")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The files a client uploads: control video and mask (MP4), two reference images (PNG)."""
    from mmgen.outputs.writers import write_video

    folder = tmp_path_factory.mktemp("inputs")
    video = np.stack([picture(HEIGHT, WIDTH, 30 + i) for i in range(FRAMES)])
    mask = np.zeros((FRAMES, HEIGHT, WIDTH, 3), np.uint8)
    mask[:, 8:24, 16:40] = 255
    paths = {
        "video": write_video(video, folder / "control.mp4"),
        "mask": write_video(mask, folder / "mask.mp4"),
    }
    for index, size in enumerate(((40, 24), (20, 30))):
        paths[f"reference{index}"] = folder / f"reference{index}.png"
        Image.fromarray(picture(*size, 40 + index)).save(paths[f"reference{index}"])
    return paths


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, vace_model: Path):
    root = tmp_path_factory.mktemp("serve-vace")
    (root / "inputs").mkdir()
    with ServerProcess(root / "state", vace_model, "--input-dir", str(root / "inputs")) as proc:
        yield proc


def post(server: ServerProcess, files: list[tuple[str, tuple[str, bytes, str]]], **fields: object):
    data = {"prompt": PROMPT, **{name: str(value) for name, value in fields.items()}}
    answer = requests.post(server.url + "/v1/videos", data=data, files=files or None, timeout=60)
    return answer.status_code, answer.json()


def upload(name: str, path: Path) -> tuple[str, tuple[str, bytes, str]]:
    kind = "video/mp4" if path.suffix == ".mp4" else "image/png"
    return name, (path.name, path.read_bytes(), kind)


def generate(model: Path, out: Path, *args: str) -> dict[str, str]:
    """What `mmgen generate` prints (name: value lines), run in this process."""
    from mmgen.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["generate", PROMPT, "--model", str(model), "--device", "cpu", "--out", str(out), *args])
    assert code == 0, printed.getvalue()
    return dict(line.split(": ", 1) for line in printed.getvalue().splitlines() if ": " in line)


def vace_uploads(inputs: dict[str, Path]) -> list[tuple[str, tuple[str, bytes, str]]]:
    """The form's files: control video, mask, two reference images (the field repeated)."""
    names = (
        ("video", "video"),
        ("mask", "mask"),
        ("reference_images", "reference0"),
        ("reference_images", "reference1"),
    )
    return [upload(field, inputs[name]) for field, name in names]


def generate_with_paths(
    model: Path, out: Path, inputs: dict[str, Path], steps: int, seed: int
) -> dict[str, str]:
    """`mmgen generate` with the files `vace_uploads` sends, as paths (guidance 4, VACE scale 0.75)."""
    args = [
        "--video",
        str(inputs["video"]),
        "--mask",
        str(inputs["mask"]),
        "--seed",
        str(seed),
        "--no-progress",
    ]
    args += ["--reference-image", str(inputs["reference0"]), "--reference-image", str(inputs["reference1"])]
    args += ["--steps", str(steps), "--guidance", "4.0", "--vace-scale", "0.75"]
    return generate(model, out, *args)


def test_uploaded_vace_inputs_match_generate_with_paths(server, vace_model, inputs, tmp_path) -> None:
    settings = {"num_inference_steps": 2, "guidance_scale": 4.0, "vace_scale": 0.75, "seed": 11}
    status, job = post(server, vace_uploads(inputs), **settings)
    assert status == 200, job
    assert job["size"] == f"{WIDTH}x{HEIGHT}", job  # the control video's size (the request names none)
    done = server.wait_for(job["id"], ("completed", "failed"))
    assert done["status"] == "completed", done
    request = done["request"]
    folder = server.state / "uploads" / job["id"]  # the job's own copies, read again after a restart
    stored = ["mask-0.mp4", "reference_images-0.png", "reference_images-1.png", "video-0.mp4"]
    assert sorted(path.name for path in folder.iterdir()) == stored
    assert (folder / "video-0.mp4").read_bytes() == inputs["video"].read_bytes()
    assert request["num_frames"] == FRAMES and (request["height"], request["width"]) == (HEIGHT, WIDTH)
    # the client sees its uploads by name, not the server's state directory
    assert (request["video"], request["mask"]) == ("upload:video-0.mp4", "upload:mask-0.mp4")
    assert request["reference_images"] == ["upload:reference_images-0.png", "upload:reference_images-1.png"]

    printed = generate_with_paths(vace_model, tmp_path / "direct.mp4", inputs, steps=2, seed=11)
    assert done["frames_sha256"] == printed["frames_sha256"]
    assert done["latents_sha256"] == printed["latents_sha256"]
    for name in ("video_sha256", "mask_sha256"):
        assert request[name] == printed[name]  # the uploaded files decode to the same frames
    assert " ".join(request["reference_images_sha256"]) == printed["reference_images_sha256"]
    content = requests.get(f"{server.url}/v1/videos/{job['id']}/content", timeout=60).content
    assert hashlib.sha256(content).hexdigest() == done["output_sha256"]
    assert done["output_sha256"] == hashlib.sha256((tmp_path / "direct.mp4").read_bytes()).hexdigest()

    assert requests.delete(f"{server.url}/v1/videos/{job['id']}", timeout=60).status_code == 200
    assert not folder.exists()  # the job's uploads go with it


def test_bad_uploads_are_400s_naming_the_field(server, inputs) -> None:
    uploads = server.state / "uploads"
    before = set(uploads.iterdir())
    mp4 = inputs["video"].read_bytes()
    cases = [
        # wrong kinds, told by the first bytes
        ([("video", ("v.mp4", b"plain text, not a video", "video/mp4"))], {}, "video", "allowed: MP4, PNG"),
        ([("reference_images", ("r.png", mp4, "image/png"))], {}, "reference_images", "file is MP4"),
        ([("input_reference", ("r.png", mp4, "image/png"))], {}, "input_reference", "allowed: PNG, JPEG"),
        # an MP4 header, then nothing decodable
        ([("video", ("v.mp4", mp4[:32], "video/mp4"))], {}, "video", "not a readable video"),
        # frames or size other than the request's: never resampled
        ([upload("video", inputs["video"])], {"num_frames": 9}, "video", "5 frames of 48x32, but the request is 9"),
        ([upload("mask", inputs["mask"])], {"size": "64x32"}, "mask", "but the request is 5 frames of 64x32"),
        # a file where none is taken; a file and a path for one field
        ([("image", ("i.png", inputs["reference0"].read_bytes(), "image/png"))], {}, "image", "a file is allowed only as"),
        ([upload("video", inputs["video"])], {"video": "control.mp4"}, "video", "given as a file and as a path"),
    ]  # fmt: skip
    for files, fields, param, text in cases:
        status, answer = post(server, files, num_inference_steps=1, **fields)
        assert status == 400, (param, answer)
        error = answer["error"]
        assert error["param"] == param and text in error["message"], (param, error)
        assert str(server.state) not in error["message"], error  # the server's paths stay its own
    assert set(uploads.iterdir()) == before  # nothing stored for a refused request
    # a named path still has to lie inside --input-dir
    status, answer = post(server, [], video="../outside.mp4")
    assert status == 400 and answer["error"]["param"] == "video", answer


def test_kill_9_and_restart_runs_the_job_on_its_uploads(vace_model, inputs, tmp_path) -> None:
    """The uploads live with the job: a server killed mid-denoise runs it again after a restart, on
    the same files, to generate's frames."""
    state = tmp_path / "state"
    settings = {"num_inference_steps": 30, "guidance_scale": 4.0, "vace_scale": 0.75, "seed": 12}
    with ServerProcess(state, vace_model) as server:
        status, job = post(server, vace_uploads(inputs), **settings)
        assert status == 200, job
        deadline = time.monotonic() + 60
        while server.request("GET", f"/v1/videos/{job['id']}")[1]["progress"] < 2:
            assert time.monotonic() < deadline, "the job never made a step"
            time.sleep(0.01)
        server.kill()
    with sqlite3.connect(state / "jobs.sqlite3") as db:  # killed mid-denoise
        assert db.execute("SELECT status FROM jobs WHERE id = ?", (job["id"],)).fetchone() == ("in_progress",)
    assert len(list((state / "uploads" / job["id"]).iterdir())) == 4
    with ServerProcess(state, vace_model) as server:
        done = server.wait_for(job["id"], ("completed", "failed", "cancelled"))
    assert done["status"] == "completed", done
    printed = generate_with_paths(vace_model, tmp_path / "direct.mp4", inputs, steps=30, seed=12)
    assert done["frames_sha256"] == printed["frames_sha256"]


def test_an_upload_decodes_only_up_to_the_servers_pixel_bound(inputs) -> None:
    """A small file can hold many frames: decoding stops once it passes --max-pixels (a 400), before
    the whole video is in memory."""
    from mmgen.serve.protocol import ApiError, Limits, video_submission

    bound = 3 * HEIGHT * WIDTH  # three frames of the five
    limits = Limits(model="m", height=HEIGHT, width=WIDTH, num_frames=FRAMES, fps=8, max_pixels=bound)
    with pytest.raises(ApiError) as caught:
        video_submission({"prompt": PROMPT}, limits, {"video": [inputs["video"]]})
    assert caught.value.status == 400 and caught.value.param == "video"
    assert f"video: decodes to more than {bound} pixels (frames x height x width)" in caught.value.message
    roomy = Limits(
        model="m", height=HEIGHT, width=WIDTH, num_frames=FRAMES, fps=8, max_pixels=5 * HEIGHT * WIDTH
    )
    assert video_submission({"prompt": PROMPT}, roomy, {"video": [inputs["video"]]}).fields["video"]


def test_web_page_uploads_the_vace_inputs(server, vace_model, inputs, tmp_path) -> None:
    """The page at / on a VACE model (GET /health lists its upload fields): file inputs for the control
    video, mask and reference images and a VACE scale field; submitting sends them as one multipart
    form, and the job's frames are `mmgen generate`'s with the same files as paths."""
    driver = chromium()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, 90, poll_frequency=0.1)
    try:
        driver.get(server.url + "/")
        wait.until(lambda d: d.find_elements(By.ID, "upload-reference_images"))
        assert driver.find_element(By.ID, "vace_scale").is_displayed()
        driver.find_element(By.ID, "upload-video").send_keys(str(inputs["video"]))
        driver.find_element(By.ID, "upload-mask").send_keys(str(inputs["mask"]))
        references = f"{inputs['reference0']}\n{inputs['reference1']}"
        driver.find_element(By.ID, "upload-reference_images").send_keys(references)
        fields = (("prompt", PROMPT), ("num_inference_steps", "2"), ("seed", "12"))
        for name, value in (*fields, ("guidance_scale", "4"), ("vace_scale", "0.75")):
            driver.find_element(By.ID, name).send_keys(value)
        before = {job["id"] for job in server.request("GET", "/v1/videos?limit=50")[1]["data"]}
        driver.find_element(By.ID, "submit").click()
        wait.until(
            lambda _: {j["id"] for j in server.request("GET", "/v1/videos?limit=50")[1]["data"]} - before
        )
        (job_id,) = {j["id"] for j in server.request("GET", "/v1/videos?limit=50")[1]["data"]} - before
        assert driver.find_element(By.ID, "error").text == ""
    finally:
        driver.quit()
    done = server.wait_for(job_id, ("completed", "failed"))
    assert done["status"] == "completed", done
    printed = generate_with_paths(vace_model, tmp_path / "direct.mp4", inputs, steps=2, seed=12)
    assert done["frames_sha256"] == printed["frames_sha256"]
