"""`mmgen serve --ray ADDRESS --replicas 2` live, on a local 2-CPU Ray cluster on loopback started here.

Two replicas drain the server's one SQLite queue: jobs sent by the official `openai` client all
complete with the frames_sha256 `mmgen generate` prints for the same request (the plain server's,
tests/test_serve_api.py), both replicas did work (/metrics per replica), a running job cancelled
through DELETE publishes nothing, and a server killed with -9 while a replica runs a job re-runs
that job after its restart, with the same SHA; no replica outlives its server. With a tiny Qwen-Image
directory, what only Qwen-Image refuses is a 400 at POST naming the field (its replica's pipeline
checks the request), and a good request's PNG is the one `mmgen generate` writes.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import re
import time
import warnings
from pathlib import Path

import pytest
from serve_cases import FAST, PROMPT, ServerProcess, reference_frames_sha256

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")
pytest.importorskip("fastapi")
from ray_cases import local_ray_cluster  # noqa: E402 - needs ray

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """A local Ray cluster of 2 CPUs on loopback; its address, for the server subprocesses to join.
    Its workers inherit PYTHONPATH (this checkout) from the raylet this process starts."""
    with local_ray_cluster({"PYTHONPATH": str(ROOT)}) as address:
        yield address


def test_ray_flags_that_cannot_run_fail_before_anything_starts(tmp_path, default_model_dir, capsys) -> None:
    from mmgen.cli import main

    base = ["serve", "--state", str(tmp_path / "state"), "--model", str(default_model_dir), "--device", "cpu"]
    cases = [
        (["--replicas", "2"], "--replicas needs --ray auto|ADDRESS"),
        (["--ray", "auto", "--replicas", "0"], "--replicas = 0: must be >= 1"),
        (["--ray", "auto", "--gpus", "2"], "--ray: use --replicas N"),
    ]
    for flags, message in cases:
        assert main([*base, *flags]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "state").exists()  # nothing started, nothing written


def replica_metrics(server: ServerProcess) -> dict[str, dict[str, float]]:
    """{metric: {replica: value}} of the per-replica counters in /metrics."""
    text = server.request("GET", "/metrics")[1].decode()
    found: dict[str, dict[str, float]] = {}
    for name, replica, value in re.findall(
        r'^mmgen_replica_(\w+)_total\{replica="([^"]+)"\} (\S+)$', text, re.M
    ):
        found.setdefault(name, {})[replica] = float(value)
    return found


def test_two_replicas_drain_one_queue_with_the_plain_servers_shas(cluster, tmp_path, default_model_dir):
    state = tmp_path / "state"
    with ServerProcess(state, default_model_dir, "--ray", cluster, "--replicas", "2") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        # The first job is slower, so the next ones are queued while it runs: both replicas take jobs.
        requests = [(11, 6), (12, 2), (13, 2), (14, 2), (15, 2)]  # (seed, steps)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            videos = [
                client.videos.create(
                    prompt=PROMPT,
                    size=FAST["size"],
                    extra_body={"num_frames": 9, "num_inference_steps": steps, "seed": seed},
                )
                for seed, steps in requests
            ]
        jobs = [server.wait_for(video.id, ("completed", "failed", "cancelled")) for video in videos]
        assert [job["status"] for job in jobs] == ["completed"] * len(requests), jobs
        for job, (seed, steps) in zip(jobs, requests, strict=True):
            assert job["frames_sha256"] == reference_frames_sha256(default_model_dir, seed, steps), job
        outputs = sorted(p.name for p in (state / "outputs").iterdir())
        assert outputs == sorted(f"{video.id}.mp4" for video in videos)
        usage = replica_metrics(server)
        assert len(usage["jobs"]) == 2 and sum(usage["jobs"].values()) == len(requests), usage
        assert all(count >= 1 for count in usage["jobs"].values()), usage  # both replicas did work
        assert all(busy > 0 for busy in usage["busy_seconds"].values()), usage

        # A running job cancelled through DELETE stops on its replica and publishes nothing.
        slow = {"prompt": PROMPT, **FAST, "num_inference_steps": 400, "seed": 5}
        status, slow_job = server.request("POST", "/v1/videos", slow)
        assert status == 200, slow_job
        deadline = time.monotonic() + 60
        while server.request("GET", f"/v1/videos/{slow_job['id']}")[1]["progress"] < 1:
            assert time.monotonic() < deadline, "the slow job never reported a step"
            time.sleep(0.05)
        assert server.request("DELETE", f"/v1/videos/{slow_job['id']}")[0] == 200
        cancelled = server.wait_for(slow_job["id"], ("completed", "failed", "cancelled"), timeout=60)
        assert cancelled["status"] == "cancelled" and cancelled["progress"] < 90, cancelled
        assert not (state / "outputs" / f"{slow_job['id']}.mp4").exists()

        # kill -9 while a replica runs a job: after a restart the job runs again, same SHA.
        status, killed = server.request(
            "POST", "/v1/videos", {"prompt": PROMPT, **FAST, "num_inference_steps": 40, "seed": 21}
        )
        assert status == 200, killed
        server.wait_for(killed["id"], ("in_progress",), timeout=60)
        server.kill()
    with ServerProcess(state, default_model_dir, "--ray", cluster, "--replicas", "1") as server:
        done = server.wait_for(killed["id"], ("completed", "failed", "cancelled"), timeout=120)
        assert done["status"] == "completed", done
        assert done["frames_sha256"] == reference_frames_sha256(default_model_dir, 21, 40)
    # Both servers' replicas are gone: the killed one's with its driver, the stopped one's by SIGTERM.
    deadline = time.monotonic() + 30
    while names := [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]:
        assert time.monotonic() < deadline, f"replicas left after the servers stopped: {names}"
        time.sleep(0.1)


QWEN_PROMPT = "a red cat sits on a green mat"


def test_a_qwen_image_server_on_ray_refuses_at_post_and_matches_generate(cluster, tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from qwen_image_cases import write_qwen_image_dir

    from mmgen.cli import main

    model = write_qwen_image_dir(tmp_path / "qwen")
    refusals = [
        ({"step_cache": 0.1}, "step_cache", "not supported by the Qwen-Image pipeline"),
        ({"preset": "distill-4step"}, "preset", "lightning-8step, lightning-4step"),
        ({"num_frames": 5}, "num_frames", "an image is 1 frame"),
    ]
    good = {"num_inference_steps": 2, "seed": 4, "response_format": "b64_json"}
    with ServerProcess(tmp_path / "state", model, "--ray", cluster, "--replicas", "1") as server:
        for extra, param, text in refusals:
            body = {"prompt": QWEN_PROMPT, "size": "48x32", **extra}
            status, answer = server.request("POST", "/v1/images/generations", body)
            assert status == 400 and answer["error"]["param"] == param, answer
            assert text in answer["error"]["message"], answer
        status, answer = server.request(
            "POST", "/v1/images/generations", {"prompt": QWEN_PROMPT, "size": "48x32", **good}
        )
        assert status == 200, answer
        metrics = server.request("GET", "/metrics")[1].decode()
    served = base64.b64decode(answer["data"][0]["b64_json"])
    assert re.search(r'^mmgen_jobs\{status="completed"\} 1\.0$', metrics, re.M), (
        metrics
    )  # refusals never queued
    assert not re.search(r'^mmgen_jobs\{status="failed"\} [1-9]', metrics, re.M), metrics
    png = tmp_path / "generate.png"
    argv = ["generate", QWEN_PROMPT, "--model", str(model), "--device", "cpu", "--width", "48"]
    argv += ["--height", "32", "--steps", "2", "--seed", "4", "--out", str(png), "--no-progress"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    assert hashlib.sha256(served).hexdigest() == hashlib.sha256(png.read_bytes()).hexdigest()
