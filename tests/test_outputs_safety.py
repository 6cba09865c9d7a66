"""Outputs under hostile conditions (issue 16): a failing encoder or full disk publishes nothing and
records nothing as done, every output location is checked before the model loads, another request's
outputs are never overwritten, and `ab` leaves no stale leftovers. A fake pipeline keeps these fast."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import numpy as np
import pytest

from mmgen.cli import main as mmgen_main
from mmgen.errors import MmgenError
from mmgen.outputs import locations
from mmgen.outputs.writers import TEMP_MARKER, frames_sha256
from mmgen.parallel.layout import ParallelLayout
from mmgen.render import manifest as manifest_module
from mmgen.render.ab import AB_LOCK_NAME, REPORT_NAME, run_ab
from mmgen.render.manifest import MANIFEST_NAME, read_manifest
from mmgen.render.runner import exclusive_output_dir, run_render
from mmgen.render.schema import RenderConfigError, load_render_file

BATCH = """\
    model: default
    device: cpu
    dtype: float32
    defaults: {height: 16, width: 16, num_frames: 5, num_inference_steps: 1}
    jobs:
      - {name: cat, prompt: a cat, seed: 1}
      - {name: dog, prompt: a dog, seed: 2}
      - {name: fox, prompt: a fox, seed: 3}
"""


def fake_factory(plan):
    """A pipeline that returns deterministic smooth frames at once (no model)."""

    def generate(request, *, progress):
        prompt, seed = request.prompt, request.seed
        kwargs = {k: v for k, v in request.fields_set().items() if k not in ("prompt", "seed")}
        t, h, w = request.num_frames or 5, request.height or 16, request.width or 16
        ramp = (np.arange(w, dtype=np.int64)[None, None, :, None] * 8 + seed * 40 + len(prompt)) % 256
        frames = np.broadcast_to(ramp, (t, h, w, 3)).astype(np.uint8)
        return SimpleNamespace(
            frames=frames,
            frames_sha256=frames_sha256(frames),
            latents_sha256="0" * 64,
            timings={"denoise": 0.0},
            fingerprint={"torch": "fake", "attention_providers": {"self": "sdpa"}},
            attention_providers={"self": "sdpa"},
            memory={},  # no GPU: no peaks (GenerationResult's field)
            args={"fps": 8, "seed": seed, **kwargs},
        )

    return SimpleNamespace(generate=generate)


def no_load(plan):
    raise AssertionError("the model must not load")


def _plan(tmp_path, text=BATCH, name="batch.yaml", out="out"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return load_render_file(path, output_dir=tmp_path / out)


def _temps(directory):
    return sorted(p.name for p in directory.rglob(f"*{TEMP_MARKER}*"))


def _fake_ffmpeg(tmp_path, body: str) -> str:
    script = tmp_path / "fake_ffmpeg.sh"
    script.write_text('#!/bin/sh\nfor last in "$@"; do :; done\nprintf "partial" > "$last"\n' + body)
    script.chmod(0o755)
    return str(script)


# --- 1. a full disk never publishes a broken video, nor records it as done -------------------------


def test_encoder_failing_on_a_full_disk_fails_the_job_and_stops_the_batch(tmp_path, monkeypatch):
    plan = _plan(tmp_path)
    body = "cat > /dev/null\necho 'Error writing trailer: No space left on device' >&2\nexit 1\n"
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", _fake_ffmpeg(tmp_path, body))
    summary = run_render(plan, pipeline_factory=fake_factory, show_progress=False)
    assert summary.exit_code == 1
    assert [o.status for o in summary.outcomes] == ["failed"] * 3
    assert "cat_s1.mp4: disk full" in summary.outcomes[0].error
    assert summary.outcomes[1].error == "not started: disk full at job cat"
    assert "failed: cat (" in summary.format() and "disk full" in summary.format()
    assert sorted(p.name for p in plan.output_dir.glob("*.mp4")) == []
    assert _temps(plan.output_dir) == []
    assert [r["status"] for r in read_manifest(plan.output_dir / MANIFEST_NAME)] == ["failed"]

    monkeypatch.delenv("IMAGEIO_FFMPEG_EXE")
    again = run_render(plan, pipeline_factory=fake_factory, show_progress=False)  # nothing was "done"
    assert [o.status for o in again.outcomes] == ["rendered"] * 3 and again.exit_code == 0


def test_cli_render_exits_nonzero_naming_the_job(tmp_path, monkeypatch, capsys):
    path = tmp_path / "batch.yaml"
    path.write_text(textwrap.dedent(BATCH))
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", _fake_ffmpeg(tmp_path, "cat > /dev/null\nexit 1\n"))
    monkeypatch.setattr("mmgen.render.runner.load_pipeline", fake_factory)
    code = mmgen_main(["render", str(path), "--out", str(tmp_path / "out"), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 1
    assert "0 rendered, 0 already done, 3 failed" in out
    assert "failed: cat (" in out and "ffmpeg exited with status 1" in out
    assert not list((tmp_path / "out").glob("*.mp4"))


def test_enospc_at_the_manifest_append_leaves_no_partial_line(tmp_path, monkeypatch):
    plan = _plan(tmp_path)
    run_render(plan, pipeline_factory=fake_factory, show_progress=False)
    manifest = plan.output_dir / MANIFEST_NAME
    before = manifest.read_bytes()

    def half_then_full(fd, data):
        os.write(fd, data[: len(data) // 2])  # the disk fills in the middle of the line
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(manifest_module, "write_once", half_then_full)
    summary = run_render(plan, resume=False, pipeline_factory=fake_factory, show_progress=False)
    assert summary.exit_code == 1
    assert summary.outcomes[0].error.startswith("rendered but not recorded: ")
    assert "manifest.jsonl: disk full" in summary.outcomes[0].error
    assert [o.status for o in summary.outcomes] == ["failed"] * 3  # stopped after the first
    assert manifest.read_bytes() == before  # truncated back: no partial line for anyone to repair


def test_repairs_are_reported(tmp_path):
    plan = _plan(tmp_path)
    run_render(plan, pipeline_factory=fake_factory, show_progress=False)
    manifest = plan.output_dir / MANIFEST_NAME
    lines = manifest.read_text().splitlines(keepends=True)
    manifest.write_text("".join(lines) + lines[0][:40])  # a kill in the middle of an append
    (plan.output_dir / "dog_s2.mp4").write_bytes(b"damaged")
    summary = run_render(plan, pipeline_factory=fake_factory, show_progress=False)
    assert [o.status for o in summary.outcomes] == ["skipped", "rendered", "skipped"]
    text = summary.format()
    assert "note: " in text and "removed 1 partial line (an interrupted run)" in text
    assert "note: dog: its finished output is missing or damaged; rendering it again" in text


# --- 2. paths that would fail late or mislead ------------------------------------------------------


def test_directory_at_an_output_path_is_refused_before_the_model_loads(tmp_path):
    plan = _plan(tmp_path)
    (plan.output_dir / "fox_s3.mp4").mkdir(parents=True)
    with pytest.raises(MmgenError, match=r"in the way of 1 output: fox_s3\.mp4 \(job fox\)"):
        run_render(plan, pipeline_factory=no_load, show_progress=False)


def test_read_only_output_directory(tmp_path, monkeypatch):
    plan = _plan(tmp_path)
    monkeypatch.setattr(locations, "is_writable", lambda directory: False)
    plan.output_dir.mkdir()
    with pytest.raises(MmgenError, match=r"out: not writable .*3 of 3 jobs still to render"):
        run_render(plan, pipeline_factory=no_load, show_progress=False)
    monkeypatch.undo()
    run_render(plan, pipeline_factory=fake_factory, show_progress=False)

    # A finished render on read-only media: reported as done, no lock taken.
    monkeypatch.setattr(locations, "is_writable", lambda directory: False)
    monkeypatch.setattr("mmgen.render.runner.exclusive_output_dir", None)
    summary = run_render(plan, pipeline_factory=no_load, show_progress=False)
    assert "0 rendered, 3 already done, 0 failed" in summary.format()
    # A missing output directory under an unwritable parent is one line too.
    other = _plan(tmp_path, out="ro/new")
    with pytest.raises(MmgenError, match=r"not writable"):
        run_render(other, pipeline_factory=no_load, show_progress=False)


def test_not_enough_free_space_for_the_first_output(tmp_path, monkeypatch):
    plan = _plan(tmp_path)
    monkeypatch.setattr(locations, "free_bytes", lambda directory: 100)
    with pytest.raises(MmgenError, match=r"job cat: disk full: 100 bytes free"):
        run_render(plan, save_frames=True, pipeline_factory=no_load, show_progress=False)


def test_outputs_of_another_render_file_are_not_overwritten(tmp_path):
    first = _plan(tmp_path)
    run_render(first, pipeline_factory=fake_factory, show_progress=False)
    mp4 = first.output_dir / "dog_s2.mp4"
    old = mp4.read_bytes()
    second = _plan(tmp_path, BATCH.replace("a dog", "a wolf"), name="other.yaml")
    with pytest.raises(
        MmgenError, match=r"dog_s2\.mp4 \(job dog\) was rendered by .*batch\.yaml for prompt 'a dog'"
    ):
        run_render(second, pipeline_factory=no_load, show_progress=False)
    assert mp4.read_bytes() == old
    summary = run_render(
        second, resume=False, pipeline_factory=fake_factory, show_progress=False
    )  # --no-resume
    assert summary.exit_code == 0 and mp4.read_bytes() != old


def test_generate_checks_its_output_before_the_model_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("mmgen.families.load_pipeline", no_load)
    (tmp_path / "taken.mp4").mkdir()
    (tmp_path / "file").write_text("x")
    cases = [
        (tmp_path / "taken.mp4", "taken.mp4: a directory is in the way of the output file"),
        (
            tmp_path / "file" / "x.mp4",
            "cannot be an output directory, " + str(tmp_path / "file") + " is a file",
        ),
    ]
    for out, expected in cases:
        assert mmgen_main(["generate", "a cat", "--out", str(out), "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("mmgen: error: ") and expected in err, err
    monkeypatch.setattr(locations, "is_writable", lambda directory: False)
    assert mmgen_main(["generate", "a cat", "--out", str(tmp_path / "new" / "x.mp4"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "not writable (read-only filesystem or no permission)" in err and err.count("\n") == 1


def test_generate_output_errors_name_the_path_and_the_real_problem(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("mmgen.families.load_pipeline", no_load)

    def error(out, *flags):
        assert mmgen_main(["generate", "a cat", "--out", str(out), "--device", "cpu", *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("mmgen: error: "), err
        return err

    # an existing directory is said to be one, not a bad suffix
    (tmp_path / "outs").mkdir()
    err = error(tmp_path / "outs")
    assert "outs' is a directory; name a file in it" in err and "suffix" not in err
    # a small output on a full disk: sizes in a unit that shows them, never "0.0 MiB"
    monkeypatch.setattr(locations, "free_bytes", lambda directory: 100)
    err = error(tmp_path / "small.mp4", "--frames", "9", "--height", "48", "--width", "48")
    assert "disk full: 100 bytes free" in err and "needs about 5.2 KiB" in err and "0.0 MiB" not in err
    assert locations.describe_size(3 << 30) == "3.0 GiB" and locations.describe_size(1536) == "1.5 KiB"
    monkeypatch.undo()
    # a read-only output directory is named
    monkeypatch.setattr("mmgen.families.load_pipeline", no_load)
    monkeypatch.setattr(locations, "is_writable", lambda directory: False)
    err = error(tmp_path / "outs" / "x.mp4")
    assert f"{tmp_path / 'outs'}: not writable (read-only filesystem or no permission)" in err


# --- 3. leftovers and stale results of `mmgen ab` --------------------------------------------------


def test_ab_cleans_leftovers_and_records_each_job_once(tmp_path):
    base = tmp_path / "batch.yaml"
    base.write_text(textwrap.dedent(BATCH))
    out = tmp_path / "ab"
    (out / "contact").mkdir(parents=True)
    leftovers = [
        out / "contact" / f".cat_s1{TEMP_MARKER}1-deadbeef.png",
        out / f".ab_report{TEMP_MARKER}1-0.json",
    ]
    for path in leftovers:
        path.write_bytes(b"half")
    (out / REPORT_NAME).write_text('{"stale": true}')
    (out / "contact" / "old_s9.png").write_bytes(b"an old comparison's sheet")
    for _ in range(2):  # a rerun without --reuse starts fresh: one "ok" record per job per side
        result = run_ab(base, sets=["attention_backend=sdpa"], out_dir=out, pipeline_factory=fake_factory)
        assert result.exit_code == 0
        for side in ("base", "candidate"):
            records = read_manifest(out / side / MANIFEST_NAME)
            assert [r["job"]["label"] for r in records] == ["cat", "dog", "fox"], side
    assert not any(path.exists() for path in leftovers)
    assert not (out / "contact" / "old_s9.png").exists()
    assert "stale" not in json.loads((out / REPORT_NAME).read_text())


def test_ab_invalidates_the_old_report_and_holds_one_lock(tmp_path):
    base = tmp_path / "batch.yaml"
    base.write_text(textwrap.dedent(BATCH))
    out = tmp_path / "ab"
    run_ab(base, sets=["attention_backend=sdpa"], out_dir=out, pipeline_factory=fake_factory)
    assert (out / REPORT_NAME).is_file()

    def dies_on_the_candidate(plan):
        pipe = fake_factory(plan)

        def interrupted(request, *, progress):
            if request.cfg_truncation == 0.5:  # only the new candidate sets it
                raise KeyboardInterrupt
            return pipe.generate(request, progress=progress)

        return SimpleNamespace(generate=interrupted)

    with pytest.raises(KeyboardInterrupt):  # a new candidate, interrupted half-way
        run_ab(base, sets=["cfg_truncation=0.5"], out_dir=out, pipeline_factory=dies_on_the_candidate)
    assert not (out / REPORT_NAME).exists()  # no complete-looking report beside mismatched renders

    with exclusive_output_dir(out, lock_name=AB_LOCK_NAME, holder="ab"):  # as a concurrent `ab` would
        with pytest.raises(MmgenError, match="another mmgen ab is writing to this directory"):
            run_ab(base, sets=["attention_backend=sdpa"], out_dir=out, pipeline_factory=fake_factory)


# --- job names ---------------------------------------------------------------------------------------


def test_bad_job_name_hides_no_other_mistake_and_case_collisions_are_refused(tmp_path):
    text = """\
        task: t2i
        jobs:
          - {name: 'a/b', prompt: x}
          - {name: fox, prompt: y, num_frames: 5}
          - {name: Fox, prompt: z}
          - {name: ok, prompt: w}
          - {name: ok, prompt: v}
    """
    path = tmp_path / "names.yaml"
    path.write_text(textwrap.dedent(text))
    with pytest.raises(RenderConfigError) as info:
        load_render_file(path)
    problems = info.value.problems
    assert len(problems) == 4, problems
    assert "jobs[0] 'a/b': name: 'a/b' is not allowed (must match the pattern '^[A-Za-z0-9]" in problems[0]
    assert "jobs[1] 'fox': num_frames: task t2i renders one frame" in problems[1]
    assert "jobs[2] 'Fox': name: 'Fox' differs from 'fox' of jobs[1] 'fox' only in case" in problems[2]
    assert "jobs[4] 'ok': name: output name 'ok_s0' is also used by jobs[3] 'ok'" in problems[3]


# --- SIGTERM, as `timeout` or a scheduler sends it ---------------------------------------------------


@pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")
def test_sigterm_during_a_render_encode_is_one_line_exit_143_and_no_temp(tmp_path, mmgen_cache_dir):
    """End to end in a subprocess: the real model, an encoder that hangs after writing part of its file."""
    out = tmp_path / "out"
    out.mkdir()
    marker = tmp_path / "encoding"
    config = tmp_path / "batch.yaml"
    config.write_text(textwrap.dedent(BATCH))
    env = {
        **os.environ,
        "MMGEN_CACHE_DIR": str(mmgen_cache_dir),
        "IMAGEIO_FFMPEG_EXE": _fake_ffmpeg(tmp_path, f"touch {marker}\nexec sleep 60\n"),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmgen.cli", "render", str(config), "--out", str(out), "--no-progress"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 300  # torch import and model load: slow on a busy CI machine
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the encode never started"
            time.sleep(0.02)
        assert _temps(out)  # the partial temp file is there now
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read().decode()
    assert code == 143, stderr
    assert stderr.endswith("\nmmgen: terminated\n") and "Traceback" not in stderr
    assert _temps(out) == [] and not list(out.glob("*.mp4"))


LATE_SIGTERM = """
import argparse, os, signal, sys
from mmgen.cli_args import run_command

def work(args):
    print("output: out.mp4")  # the work is done and reported; stdout is a pipe (block-buffered)
    return 0

status = run_command(argparse.Namespace(func=work))
os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's SIGTERM in the last moment before the exit
signal.sigtimedwait([signal.SIGUSR1], 5)  # the handler runs at the next bytecode; never reached
print("not stopped", file=sys.stderr)
sys.exit(status)
"""


@pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")
def test_sigterm_after_the_output_is_published_is_143_with_a_line_saying_so(tmp_path):
    # Seen: exit 143 and nothing else, even the printed path lost with the unflushed stdout. The
    # work is done, yet SIGTERM still ends the process as one expects of it (143, as `timeout` and
    # schedulers see it), after the result lines and one line saying the output was published.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", LATE_SIGTERM], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGTERM, proc  # killed by the signal: the shell's 143
    assert proc.stdout == "output: out.mp4\n"
    assert proc.stderr == (
        "mmgen: terminated after the command finished (status 0); its outputs are published\n"
    )


@pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")
@pytest.mark.parametrize("command", ["generate", "ab"])
def test_sigterm_in_generate_and_ab(tmp_path, monkeypatch, capsys, command):
    """In this process: the fake encoder sends SIGTERM to its parent, the CLI must turn it into exit 143."""
    # What was there before this call (an earlier finished command of this process leaves its
    # after-the-work handler until a SIGTERM or the exit: run_command).
    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", _fake_ffmpeg(tmp_path, "kill -TERM $PPID\nexec sleep 60\n"))
    out = tmp_path / "out"
    if command == "generate":
        from pipelines.common import write_frames

        def load(*args, **kwargs):
            pipe = fake_factory(None)

            def generate(request, *, progress):
                result = pipe.generate(request.with_values(num_frames=5), progress=progress)
                result.save = lambda path, fps: write_frames(result.frames, path, fps=8)
                return result

            # what `mmgen generate` asks of a pipeline besides generate(request)
            return SimpleNamespace(generate=generate, layout=ParallelLayout.single())

        monkeypatch.setattr("mmgen.families.load_pipeline", load)
        argv = ["generate", "a cat", "--out", str(out / "cat.mp4"), "--device", "cpu"]
    else:
        monkeypatch.setattr("mmgen.render.ab.load_pipeline", fake_factory)
        config = tmp_path / "batch.yaml"
        config.write_text(textwrap.dedent(BATCH))
        argv = ["ab", str(config), "--set", "attention_backend=sdpa", "--out", str(out)]
    assert mmgen_main([*argv, "--no-progress"]) == 143
    assert capsys.readouterr().err == "mmgen: terminated\n"
    assert _temps(out) == [] and not list(out.rglob("*.mp4"))
    assert signal.getsignal(signal.SIGTERM) == before  # the CLI's handler is gone again
