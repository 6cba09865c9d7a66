"""Pieces the render kill tests share: a `mmgen render` subprocess SIGKILLed once its jobs have started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mmgen.render.runner import JOB_START_HOOK_ENV


def kill_render_after_starts(
    config: Path,
    out: Path,
    cache_dir: Path,
    hook: Path,
    *,
    starts: int,
    never_started: str,
    extra_args: tuple[str, ...] = (),
    settle_s: float = 0.0,
) -> subprocess.Popen:
    """Run `mmgen render CONFIG --out OUT` in a subprocess (the runner's job-start hook writing to
    `hook`), wait until `starts` jobs have started, wait `settle_s` more and SIGKILL it.

    Fails with the render's stderr if it exits first, and with `never_started` after 240 s; returns
    the finished process (never left running)."""
    env = {**os.environ, "MMGEN_CACHE_DIR": str(cache_dir), JOB_START_HOOK_ENV: str(hook)}
    command = [sys.executable, "-m", "mmgen.cli", "render", str(config), "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(
        [*command, *extra_args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 240
        while not (hook.exists() and len(hook.read_text().splitlines()) >= starts):
            assert proc.poll() is None, f"render exited early: {proc.stderr.read().decode()}"
            assert time.monotonic() < deadline, never_started
            time.sleep(0.01)
        if settle_s:
            time.sleep(settle_s)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc
