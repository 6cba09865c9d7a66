"""Output writers (mp4, png, bytes) that never leave a truncated file under a final name, and hashes.

Every writer goes through the same steps: write to a temp file in the destination directory (same
filesystem, so the rename is atomic), flush and fsync it, `os.replace` it onto the final name, then
fsync the directory so the rename itself survives a power loss. A kill at any moment leaves either
the old file (or none) or the complete new one; at worst a stale temp file whose name contains
TEMP_MARKER, which `remove_stale_temps` deletes on the next run.

Output identity (DESIGN.md, Reproducibility): the sha256 of the decoded uint8 frames, never of the
container bytes (encoders embed versions and settings), plus a hash of the final latents.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from mmgen.errors import MmgenError, ValidationError


def ffmpeg_exe() -> str:
    """The ffmpeg binary imageio-ffmpeg ships. Imported here, not at the top: hashing files and
    writing PNGs (what a GPU host without the 68 MB ffmpeg wheel still does) need no ffmpeg."""
    import imageio_ffmpeg

    return imageio_ffmpeg.get_ffmpeg_exe()


# Every temp file this module creates has this in its name (and starts with a dot), so a later run
# can find and delete leftovers of a killed one without touching anything else.
TEMP_MARKER = ".mmgen-tmp-"

# Video encoding: H.264 (libx264) in yuv420p, the pixel format every player decodes. CRF 18 with the
# "medium" preset is visually near-lossless at a moderate size; the mp4 is for people to look at, the
# identity of an output is `frames_sha256` of the uint8 frames before encoding.
VIDEO_CODEC = "libx264"
VIDEO_PIXEL_FORMAT = "yuv420p"
VIDEO_CRF = 18
VIDEO_PRESET = "medium"


class OutputWriteError(MmgenError):
    """An output could not be written (encoder failure, full disk); nothing was published at its path."""

    def __init__(self, message: str, *, disk_full: bool = False):
        super().__init__(message)
        self.disk_full = disk_full  # the runner stops a batch on a full disk instead of failing each job


DISK_FULL = "disk full"


def frames_sha256(frames: np.ndarray) -> str:
    """sha256 identity of frames (any dtype/shape, typically uint8 [T, H, W, 3]).

    Recipe (stable; other tools can recompute it): sha256 over the ASCII header
    ``f"{frames.dtype.str}|{','.join(str(d) for d in frames.shape)}\\n"`` (for uint8 frames of shape
    (9, 64, 64, 3) that is ``"|u1|9,64,64,3\\n"``) followed by the C-contiguous bytes of the array.
    The header makes two arrays with the same bytes but a different shape or dtype hash differently.
    """
    array = np.ascontiguousarray(frames)
    digest = hashlib.sha256()
    digest.update(_header(array.dtype.str, array.shape))
    digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes: an input's identity (LoRA files) or a check that an output is undamaged
    (never an output's identity, which is frames_sha256)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 identity of a tensor of any dtype/shape/device (e.g. latents [B, C, T, H, W]).

    Recipe: sha256 over the ASCII header ``f"{t.dtype}|{','.join(str(d) for d in t.shape)}\\n"``
    (e.g. ``"torch.float32|1,16,3,8,8\\n"``) followed by the bytes of the tensor moved to the CPU and
    made contiguous (native little-endian layout; bfloat16 and other dtypes numpy lacks are hashed via
    a uint8 view of the same memory).
    """
    cpu = t.detach().to("cpu").contiguous()
    raw = cpu.reshape(-1).view(torch.uint8).numpy()
    digest = hashlib.sha256()
    digest.update(_header(str(cpu.dtype), tuple(cpu.shape)))
    digest.update(memoryview(np.ascontiguousarray(raw)).cast("B"))
    return digest.hexdigest()


def _header(dtype_name: str, shape: tuple[int, ...]) -> bytes:
    return f"{dtype_name}|{','.join(str(int(d)) for d in shape)}\n".encode("ascii")


def temp_path_for(path: Path) -> Path:
    """A fresh temp name next to `path`, keeping its suffix (ffmpeg picks the container from it)."""
    return path.with_name(f".{path.stem}{TEMP_MARKER}{os.getpid()}-{uuid.uuid4().hex[:8]}{path.suffix}")


def remove_stale_temps(directory: Path) -> list[Path]:
    """Delete temp files that a killed writer left in `directory`; returns the removed paths."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for candidate in sorted(directory.glob(f".*{TEMP_MARKER}*")):
        if candidate.is_file():
            candidate.unlink(missing_ok=True)
            removed.append(candidate)
    return removed


@contextlib.contextmanager
def atomic_destination(path: Path | str) -> Iterator[Path]:
    """Yield a temp path to write; on success fsync it and rename it onto `path`, else delete it."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_path_for(final)
    try:
        yield temp
        if not temp.is_file():
            raise OSError(f"{final}: the writer produced no file")
        fsync_file(temp)
        os.replace(temp, final)
    finally:
        temp.unlink(missing_ok=True)
    _fsync_directory(final.parent)


def fsync_file(path: Path) -> None:
    """Flush one file's data to disk (before a rename publishes it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(directory: Path) -> None:
    # Makes the rename durable. Some filesystems refuse fsync on a directory; the rename still holds.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path | str, data: bytes) -> Path:
    """Write `data` to `path` atomically (temp file + fsync + rename); returns the final path.

    A failed write (a full disk) raises OutputWriteError naming `path` and leaves no temp file.
    """
    with reporting_os_errors(Path(path)), atomic_destination(path) as temp:
        with open(temp, "wb") as fh:
            fh.write(data)
    return Path(path)


def atomic_write_text(path: Path | str, text: str) -> Path:
    """Write UTF-8 `text` to `path` atomically; returns the final path."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def _check_frames(frames: np.ndarray, *, ndim: int, what: str, channels: tuple[int, ...] = (3,)) -> None:
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8:
        raise ValidationError(
            f"{what}: expected a numpy uint8 array, got {type(frames).__name__}"
            f"{'' if not isinstance(frames, np.ndarray) else ' of ' + str(frames.dtype)}"
        )
    if frames.ndim != ndim or frames.shape[-1] not in channels:
        last = " or ".join(str(c) for c in channels)
        layout = f"[T, H, W, {last}]" if ndim == 4 else f"[H, W, {last}]"
        raise ValidationError(f"{what}: expected shape {layout}, got {tuple(frames.shape)}")
    if frames.size == 0:
        raise ValidationError(f"{what}: empty array of shape {tuple(frames.shape)}")


def write_video(frames: np.ndarray, path: Path | str, fps: int = 16) -> Path:
    """Encode uint8 frames [T, H, W, 3] (RGB) as an H.264/yuv420p mp4 at `path`, atomically.

    The encoder's exit status is checked and the finished container is read back (frame count and
    size) before the rename, so a failed or truncated encode (a full disk) never reaches `path`:
    it raises OutputWriteError ("disk full" when the disk is) and leaves no temp file.
    """
    _check_frames(frames, ndim=4, what=f"write_video({path})")
    count, height, width, _ = frames.shape
    if height % 2 or width % 2:
        # yuv420p subsamples chroma 2x2; we refuse rather than silently resize or crop.
        raise ValidationError(
            f"write_video({path}): yuv420p needs even height and width, got {height}x{width}"
        )
    if int(fps) < 1:
        raise ValidationError(f"write_video({path}): fps must be >= 1, got {fps}")
    final = Path(path)
    with reporting_os_errors(final), atomic_destination(final) as temp:
        encode_mp4(frames, temp, fps=int(fps), shown_as=final)
        check_video(temp, final=final, frames=count, width=width, height=height)
    return final


def encode_mp4(frames: np.ndarray, path: Path, *, fps: int, shown_as: Path | None = None) -> None:
    """Run ffmpeg on uint8 frames [T, H, W, 3] -> `path`; raises OutputWriteError when ffmpeg fails.

    `shown_as` is the path named in the error (the final name when `path` is a temp file).

    Driven directly rather than through imageio-ffmpeg's write_frames generator, which ignores
    ffmpeg's exit status (a full disk fails only at the trailer, after every frame was accepted).
    The binary is imageio-ffmpeg's (IMAGEIO_FFMPEG_EXE overrides it).
    """
    _, height, width, _ = frames.shape
    command = [
        ffmpeg_exe(),
        "-nostdin",
        "-hide_banner",
        "-v",
        "error",
        "-y",
        "-f",
        "rawvideo",
        "-pix_fmt",
        "rgb24",
        "-s",
        f"{width}x{height}",
        "-r",
        str(fps),
        "-i",
        "-",
        "-an",
        "-c:v",
        VIDEO_CODEC,
        "-pix_fmt",
        VIDEO_PIXEL_FORMAT,
        "-crf",
        str(VIDEO_CRF),
        "-preset",
        VIDEO_PRESET,
        str(path),
    ]
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        # communicate() feeds stdin and drains stderr together, so neither pipe can fill and block.
        _, stderr = process.communicate(np.ascontiguousarray(frames).tobytes())
    finally:
        if process.poll() is None:  # interrupted (SIGINT/SIGTERM): do not leave ffmpeg running
            process.kill()
            process.wait()
    if process.returncode != 0:
        text = stderr.decode("utf-8", "replace")
        last = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")
        cause = DISK_FULL if _mentions_enospc(text) else f"ffmpeg exited with status {process.returncode}"
        raise OutputWriteError(
            f"{shown_as or path}: {cause}{f' ({last})' if last else ''}", disk_full=cause == DISK_FULL
        )


def check_video(path: Path, *, final: Path, frames: int, width: int, height: int) -> None:
    """Read the container's packets back (no decoding) and compare frame count and size.

    The count comes from the container itself: ffmpeg's framecrc muxer on a stream copy prints one
    line per packet (an H.264 packet in mp4 is one frame) and a "#dimensions" header, on stdout, in
    the same format from ffmpeg 4.2 to 9. The "frame=" progress line is not used: ffmpeg 7.0 prints
    none for a stream copy (imageio-ffmpeg 0.6.0 ships 7.0.2), and it is a log, not an interface.
    """
    command = [ffmpeg_exe(), "-nostdin", "-hide_banner", "-v", "error", "-i", str(path)]
    command += ["-map", "0:v:0", "-c", "copy", "-f", "framecrc", "-"]
    result = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, check=False)
    got_frames, got_size = count_packets(result.stdout.decode("utf-8", "replace"))
    if result.returncode != 0 or got_frames != frames or got_size != (width, height):
        found = (
            "unreadable"
            if result.returncode != 0 or got_size is None
            else f"{got_frames} frames of {got_size[0]}x{got_size[1]}"
        )
        raise OutputWriteError(
            f"{final}: the encoded video does not read back ({found}; expected {frames} frames of "
            f"{width}x{height}); not published"
        )


def count_packets(framecrc: str) -> tuple[int, tuple[int, int] | None]:
    """(packets, (width, height) or None) of stream 0 in ffmpeg's framecrc listing.

    The listing: "#name 0: value" header lines ("#dimensions 0: 48x48"), then one line per packet,
    "stream, dts, pts, duration, size, crc[, F=flags]", e.g. "0,      -1024,       1024,     1024,
    1653, 0xbb122747, F=0x0".
    """
    packets, size = 0, None
    for line in framecrc.splitlines():
        if line.startswith("#dimensions 0:"):
            width, _, height = line.partition(":")[2].strip().partition("x")
            if width.isdigit() and height.isdigit():
                size = (int(width), int(height))
        elif line.startswith("0,"):
            packets += 1
    return packets, size


def _mentions_enospc(text: str) -> bool:
    return "No space left on device" in text or os.strerror(errno.ENOSPC) in text


def write_png(frame: np.ndarray, path: Path | str) -> Path:
    """Write one uint8 frame [H, W, 3] (RGB) or [H, W, 4] (RGBA, Qwen-Image-2.1) as a lossless png at
    `path`, atomically (an mp4 takes RGB only: write_video refuses four channels)."""
    _check_frames(frame, ndim=3, what=f"write_png({path})", channels=(3, 4))
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(frame)).save(buffer, format="PNG")
    return atomic_write_bytes(path, buffer.getvalue())


@contextlib.contextmanager
def reporting_os_errors(path: Path) -> Iterator[None]:
    """An OSError inside becomes OutputWriteError: one line naming `path` (describe_write_error)."""
    try:
        yield
    except OSError as err:
        raise OutputWriteError(describe_write_error(path, err), disk_full=is_disk_full(err)) from err


def is_disk_full(err: OSError) -> bool:
    return err.errno in (errno.ENOSPC, errno.EDQUOT)


def describe_write_error(path: Path | str, err: OSError) -> str:
    """One line for a failed write of `path`: "disk full" for ENOSPC/EDQUOT, else the OS reason."""
    if is_disk_full(err):
        return f"{path}: {DISK_FULL} ({err.strerror or 'no space left on device'})"
    return f"{path}: cannot write ({err.strerror or err})"
