"""kill -9 `mmgen serve` with one job running and others queued; a restart completes them all with
the frames `mmgen generate` makes for the same requests (the interrupted one runs again from the
start, same seed), and nothing half-written is ever served."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import time
import urllib.parse
from pathlib import Path

import pytest
from serve_cases import FAST, PROMPT, ServerProcess, reference_frames_sha256

pytest.importorskip("fastapi")


def test_kill_9_and_restart_completes_every_job(tmp_path: Path, default_model_dir: Path) -> None:
    state = tmp_path / "state"
    # The first job runs long enough to be killed mid-denoise; the others wait behind it.
    slow = {"prompt": PROMPT, **FAST, "num_inference_steps": 6, "seed": 7}
    requests = [slow, {"prompt": PROMPT, **FAST, "seed": 8}, slow]
    with ServerProcess(state, default_model_dir) as server:
        ids = []
        for body in requests:
            status, job = server.request("POST", "/v1/videos", body)
            assert status == 200, job
            ids.append(job["id"])
        deadline = time.monotonic() + 60
        while server.request("GET", f"/v1/videos/{ids[0]}")[1]["progress"] < 2:
            assert time.monotonic() < deadline, "the first job never made a step"
            time.sleep(0.01)
        server.kill()
    with sqlite3.connect(state / "jobs.sqlite3") as db:  # what the crash left: one running, two queued
        rows = dict(db.execute("SELECT id, status FROM jobs").fetchall())
    assert [rows[video_id] for video_id in ids] == ["in_progress", "queued", "queued"], rows
    before = {p.name for p in (state / "outputs").iterdir()}
    assert not [name for name in before if ids[0] in name and not name.startswith(".")], before

    with ServerProcess(state, default_model_dir) as server:
        first = server.request("GET", f"/v1/videos/{ids[0]}")[1]
        assert first["status"] in ("queued", "in_progress", "completed"), first
        done = [server.wait_for(video_id, ("completed", "failed", "cancelled")) for video_id in ids]
    assert [job["status"] for job in done] == ["completed"] * 3, done
    assert done[0]["frames_sha256"] == reference_frames_sha256(default_model_dir, 7, steps=6)
    assert done[1]["frames_sha256"] == reference_frames_sha256(default_model_dir, 8)
    assert done[2]["frames_sha256"] == done[0]["frames_sha256"]
    assert not [p for p in (state / "outputs").iterdir() if p.name.startswith(".")]  # no temp left


def test_an_accepted_job_survives_a_kill_right_after_the_answer(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """The job row is committed before POST answers: SIGKILL the server the moment its whole answer
    has arrived; a restart on the same state has the job and completes it with `mmgen generate`'s
    frames."""
    state = tmp_path / "state"
    body = json.dumps({"prompt": PROMPT, **FAST, "seed": 7}).encode()
    with ServerProcess(state, default_model_dir) as server:
        url = urllib.parse.urlsplit(server.url)
        with socket.create_connection((url.hostname, url.port), timeout=30) as conn:
            conn.sendall(
                b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            answer = b""
            while not _whole_response(answer):
                chunk = conn.recv(65536)
                assert chunk, answer
                answer += chunk
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGKILL)  # at once: no grace for a commit after the answer
        server.proc.wait(timeout=30)
        head, _, text = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), answer
        video_id = json.loads(text)["id"]
    with ServerProcess(state, default_model_dir) as server:
        assert server.request("GET", f"/v1/videos/{video_id}")[0] == 200, "the accepted job was lost"
        done = server.wait_for(video_id, ("completed", "failed", "cancelled"))
    assert done["status"] == "completed", done
    assert done["frames_sha256"] == reference_frames_sha256(default_model_dir, 7)


def _whole_response(data: bytes) -> bool:
    """Whether `data` holds an HTTP response's head and its Content-Length bytes of body."""
    head, found, body = data.partition(b"\r\n\r\n")
    if not found:
        return False
    lengths = [
        line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
    ]
    return bool(lengths) and len(body) >= int(lengths[0])
