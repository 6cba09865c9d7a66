"""Atomic output writers and the identity hashes (frames and tensors)."""

from __future__ import annotations

import errno
import hashlib
from pathlib import Path

import imageio_ffmpeg
import numpy as np
import pytest
import torch
from PIL import Image

from mmgen.errors import ValidationError
from mmgen.outputs import writers
from mmgen.outputs.writers import (
    TEMP_MARKER,
    OutputWriteError,
    atomic_write_bytes,
    atomic_write_text,
    check_video,
    count_packets,
    frames_sha256,
    remove_stale_temps,
    tensor_sha256,
    write_png,
    write_video,
)


def _frames(t: int = 5, h: int = 32, w: int = 48, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(t, h, w, 3), dtype=np.uint8)


def _temps(directory) -> list:
    return [p for p in directory.iterdir() if TEMP_MARKER in p.name]


def test_mp4_has_requested_frames_and_size(tmp_path):
    frames = _frames(t=9)
    out = write_video(frames, tmp_path / "clip.mp4", fps=16)
    assert out == tmp_path / "clip.mp4"
    nframes, _ = imageio_ffmpeg.count_frames_and_secs(str(out))
    assert nframes == 9
    reader = imageio_ffmpeg.read_frames(str(out))
    meta = reader.__next__()
    assert tuple(meta["size"]) == (48, 32)
    assert meta["fps"] == 16
    decoded = [np.frombuffer(buf, np.uint8).reshape(32, 48, 3) for buf in reader]
    assert len(decoded) == 9
    assert _temps(tmp_path) == []


def test_mp4_is_close_on_smooth_content(tmp_path):
    # Lossy, but a smooth gradient must survive CRF 18 closely: proves the frames are ours, in order.
    ramp = np.linspace(0, 255, 64, dtype=np.float32)
    frames = np.stack(
        [np.broadcast_to(((ramp[None, :, None] + 20 * t) % 256), (32, 64, 3)) for t in range(5)]
    )
    frames = frames.astype(np.uint8)
    out = write_video(frames, tmp_path / "ramp.mp4")
    reader = imageio_ffmpeg.read_frames(str(out))
    reader.__next__()
    decoded = np.stack([np.frombuffer(buf, np.uint8).reshape(32, 64, 3) for buf in reader])
    assert decoded.shape == frames.shape
    assert np.abs(decoded.astype(int) - frames.astype(int)).mean() < 6


def test_png_round_trip_is_exact(tmp_path):
    frame = _frames(t=1, h=16, w=24)[0]
    out = write_png(frame, tmp_path / "img.png")
    back = np.asarray(Image.open(out).convert("RGB"))
    assert back.dtype == np.uint8
    assert np.array_equal(back, frame)
    assert _temps(tmp_path) == []


def test_frames_sha256_recipe_and_sensitivity():
    frames = _frames(t=2, h=4, w=4)
    expected = hashlib.sha256(b"|u1|2,4,4,3\n" + frames.tobytes()).hexdigest()
    assert frames_sha256(frames) == expected
    # A non-contiguous view hashes like its contiguous copy.
    assert frames_sha256(frames[:, ::-1][:, ::-1]) == expected
    changed = frames.copy()
    changed[1, 3, 2, 1] ^= 1
    assert frames_sha256(changed) != expected
    # Same bytes, different shape: different identity.
    assert frames_sha256(frames.reshape(1, 8, 4, 3)) != expected


def test_tensor_sha256_recipe_dtype_and_sensitivity():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    expected = hashlib.sha256(b"torch.float32|3,4\n" + t.numpy().tobytes()).hexdigest()
    assert tensor_sha256(t) == expected
    assert tensor_sha256(t.t().contiguous().t()) == expected  # non-contiguous input, same values
    bumped = t.clone()
    bumped[2, 3] = torch.nextafter(bumped[2, 3], torch.tensor(100.0))
    assert tensor_sha256(bumped) != expected
    assert tensor_sha256(t.to(torch.bfloat16)) != tensor_sha256(t.to(torch.float16))
    assert len(tensor_sha256(torch.tensor(3.0, dtype=torch.bfloat16))) == 64


def test_atomic_write_text_and_bytes(tmp_path):
    target = tmp_path / "sub" / "a.json"
    atomic_write_text(target, '{"x": 1}')
    assert target.read_text() == '{"x": 1}'
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert _temps(target.parent) == []


def test_failing_write_keeps_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "clip.mp4"
    write_video(_frames(t=3), target)
    old = target.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(writers.os, "replace", broken_replace)
    with pytest.raises(OutputWriteError, match="simulated"):
        write_video(_frames(t=5, seed=1), target)
    with pytest.raises(OutputWriteError, match="simulated"):
        write_png(_frames(t=1)[0], tmp_path / "img.png")
    monkeypatch.undo()
    assert target.read_bytes() == old
    assert not (tmp_path / "img.png").exists()
    assert _temps(tmp_path) == []


def test_failing_encode_keeps_old_file(tmp_path):
    target = tmp_path / "clip.mp4"
    write_video(_frames(t=3), target)
    old = target.read_bytes()
    with pytest.raises(ValidationError, match="even height and width"):
        write_video(_frames(t=3, h=31), target)
    with pytest.raises(ValidationError, match="uint8"):
        write_video(_frames(t=3).astype(np.float32), target)
    assert target.read_bytes() == old
    assert _temps(tmp_path) == []


def test_remove_stale_temps_only_removes_ours(tmp_path):
    stale = tmp_path / f".job{TEMP_MARKER}123-abcd.mp4"
    stale.write_bytes(b"partial")
    keep = tmp_path / "job.mp4"
    keep.write_bytes(b"complete")
    assert remove_stale_temps(tmp_path) == [stale]
    assert keep.exists() and not stale.exists()


RECORDINGS = Path(__file__).parent / "ffmpeg_recordings"
# imageio-ffmpeg's bundled ffmpeg (linux-x86_64) of the lowest allowed, a failing and the newest version.
RECORDED = ("ffmpeg-4.2.2", "ffmpeg-7.0.2", "ffmpeg-9.0.2")


def _replaying_ffmpeg(tmp_path, version: str) -> str:
    """An 'ffmpeg' that prints what `version` printed for a read-back of a 9-frame 48x48 mp4."""
    recorded = RECORDINGS / version
    stdout, stderr = recorded / "framecrc.stdout", recorded / "null.stderr"
    script = tmp_path / f"ffmpeg-{version}.sh"
    script.write_text(
        f'#!/bin/sh\ncase "$*" in\n  *framecrc*) cat "{stdout}" ;;\n  *) cat "{stderr}" >&2 ;;\nesac\n'
    )
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize("version", RECORDED)
def test_read_back_counts_frames_with_every_allowed_ffmpeg(tmp_path, monkeypatch, version):
    # imageio-ffmpeg 0.6.0's ffmpeg 7.0.2 prints no "frame=" line for a stream copy: a read-back
    # parsing it refused every video. The framecrc listing counts the container's packets instead.
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", _replaying_ffmpeg(tmp_path, version))
    clip = tmp_path / "clip.mp4"
    check_video(clip, final=clip, frames=9, width=48, height=48)
    with pytest.raises(OutputWriteError, match=r"\(9 frames of 48x48; expected 10 frames of 48x48\)"):
        check_video(clip, final=clip, frames=10, width=48, height=48)
    listing = (RECORDINGS / version / "framecrc.stdout").read_text()
    assert count_packets(listing) == (9, (48, 48))
    assert count_packets("") == (0, None)


def test_read_back_of_a_real_encode_with_the_installed_ffmpeg(tmp_path):
    import subprocess

    out = write_video(_frames(t=9, h=48, w=48), tmp_path / "clip.mp4", fps=8)
    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-nostdin", "-v", "error", "-i", str(out)]
    command += ["-map", "0:v:0", "-c", "copy", "-f", "framecrc", "-"]
    listing = subprocess.run(command, capture_output=True, check=True, text=True).stdout
    assert count_packets(listing) == (9, (48, 48))
    check_video(out, final=out, frames=9, width=48, height=48)


def _fake_ffmpeg(tmp_path, *, status: int, message: str) -> str:
    """An 'ffmpeg' that writes a few bytes to its last argument, drains stdin and exits `status`."""
    script = tmp_path / "fake_ffmpeg.sh"
    script.write_text(
        "#!/bin/sh\n"
        'for last in "$@"; do :; done\n'
        'printf "partial" > "$last"\n'
        "cat > /dev/null\n"
        f"echo '{message}' >&2\n"
        f"exit {status}\n"
    )
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("[out#0/mp4] Error writing trailer: No space left on device", "disk full"),
        ("Conversion failed!", "ffmpeg exited with status 1"),
    ],
)
def test_failing_encoder_raises_and_publishes_nothing(tmp_path, monkeypatch, message, expected):
    target = tmp_path / "clip.mp4"
    write_video(_frames(t=3), target)
    old = target.read_bytes()
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", _fake_ffmpeg(tmp_path, status=1, message=message))
    with pytest.raises(OutputWriteError, match=expected) as info:
        write_video(_frames(t=5, seed=1), target)
    assert "clip" in str(info.value)
    with pytest.raises(OutputWriteError, match=expected):
        write_video(_frames(t=5, seed=1), tmp_path / "new.mp4")
    assert target.read_bytes() == old
    assert not (tmp_path / "new.mp4").exists()
    assert _temps(tmp_path) == []


def test_truncated_container_is_not_published(tmp_path, monkeypatch):
    # An encoder that "succeeds" but leaves half a file (a full disk hit after the exit status).
    real_encode = writers.encode_mp4

    def truncating_encode(frames, path, *, fps, shown_as=None):
        real_encode(frames, path, fps=fps)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])

    monkeypatch.setattr(writers, "encode_mp4", truncating_encode)
    with pytest.raises(OutputWriteError, match="does not read back"):
        write_video(_frames(t=5), tmp_path / "clip.mp4")
    assert not (tmp_path / "clip.mp4").exists()
    assert _temps(tmp_path) == []


def test_enospc_while_writing_reads_disk_full(tmp_path, monkeypatch):
    def full_disk(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writers.os, "replace", full_disk)
    with pytest.raises(OutputWriteError, match=r"img\.png: disk full"):
        write_png(_frames(t=1)[0], tmp_path / "img.png")
    with pytest.raises(OutputWriteError, match=r"report\.json: disk full"):
        atomic_write_text(tmp_path / "report.json", "{}")
    assert list(tmp_path.iterdir()) == []
