"""A render killed with SIGKILL during job 2 loses only job 2; the rerun completes the batch exactly."""

from __future__ import annotations

import json
import signal
import textwrap

import imageio_ffmpeg
import pytest
from render_cases import kill_render_after_starts

from mmgen.outputs.writers import TEMP_MARKER
from mmgen.render.manifest import MANIFEST_NAME
from mmgen.render.runner import JOB_START_HOOK_ENV, LOCK_NAME, load_pipeline, run_render
from mmgen.render.schema import load_render_file

# Job 2 is the heavy one so that the kill, sent just after it starts, lands inside it.
BATCH = """\
    model: default
    device: cpu
    dtype: float32
    defaults: {height: 16, width: 16, num_frames: 5, num_inference_steps: 1, guidance_scale: 1.0, max_sequence_length: 16}
    jobs:
      - {name: first, prompt: a cat, seed: 1}
      - {name: second, prompt: a dog running, seed: 2, height: 96, width: 96, num_frames: 13, num_inference_steps: 4, guidance_scale: 5.0}
      - {name: third, prompt: a boat, seed: 3}
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_during_job_two_then_rerun(tmp_path, mmgen_cache_dir, monkeypatch):
    config = tmp_path / "batch.yaml"
    config.write_text(textwrap.dedent(BATCH))
    out = tmp_path / "out"
    hook = tmp_path / "job_starts.txt"
    # sent 0.02 s after job 2 starts: into job 2 (about a second of work on 1 CPU thread)
    proc = kill_render_after_starts(
        config, out, mmgen_cache_dir, hook, starts=2, never_started="job 2 never started", settle_s=0.02
    )
    assert proc.returncode == -signal.SIGKILL
    assert hook.read_text().splitlines() == ["0 first", "1 second"]
    lines = (out / MANIFEST_NAME).read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["job"]["label"] == "first"  # killed inside job 2
    assert not (out / "second_s2.mp4").exists()

    monkeypatch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
    monkeypatch.delenv(JOB_START_HOOK_ENV, raising=False)
    plan = load_render_file(config, output_dir=out)
    summary = run_render(plan, show_progress=False)
    assert [o.status for o in summary.outcomes] == ["skipped", "rendered", "rendered"]

    text = (out / MANIFEST_NAME).read_text()
    assert text.endswith("\n")
    records = [json.loads(line) for line in text.splitlines()]  # every line complete JSON
    assert [r["job"]["label"] for r in records] == ["first", "second", "third"]
    assert all(r["status"] == "ok" for r in records)
    assert not [p for p in out.iterdir() if TEMP_MARKER in p.name]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [LOCK_NAME]
    for record in records:
        video = out / record["outputs"][0]["path"]
        assert imageio_ffmpeg.count_frames_and_secs(str(video))[0] == record["frames_shape"][0]

    # The manifest's identities are the frames' identities: rendering each job again (here, in
    # another process than the killed one that made job 1) reproduces its frames sha256 exactly.
    pipe = load_pipeline(plan)
    for job, record in zip(plan.jobs, records, strict=True):
        result = pipe.generate(job.request, progress=False)
        assert result.frames_sha256 == record["frames_sha256"], job.label
        assert result.latents_sha256 == record["latents_sha256"], job.label
