"""Output-location checks run before any model loads: each failure is one line naming the path.

A request whose output cannot be written must fail in a second, not after the whole generation:
the directory must be creatable and writable, nothing but a regular file may sit at an output path,
and the disk must hold at least a rough lower bound of the first output's size.

`is_writable` and `free_bytes` are the seams tests replace: the tests run as root, which `chmod`
does not stop, and a full or read-only filesystem cannot be mounted in every sandbox.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mmgen.errors import MmgenError

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30


class OutputLocationError(MmgenError):
    """An output path cannot be written: names the path and the reason."""


def is_writable(directory: Path) -> bool:
    """Whether this process may create files in `directory` (access(2): EROFS counts even for root)."""
    return os.access(directory, os.W_OK | os.X_OK)


def free_bytes(directory: Path) -> int:
    """Bytes available to this process on the filesystem holding `directory`."""
    return shutil.disk_usage(directory).free


def existing_ancestor(path: Path) -> Path:
    """`path` itself or its nearest existing parent (where a missing directory would be created)."""
    path = Path(path).absolute()
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(path.anchor)


def check_output_dir(directory: Path) -> Path:
    """`directory` exists or can be created there, is a directory and is writable; returns it."""
    directory = Path(directory)
    base = existing_ancestor(directory)
    if not base.is_dir():
        raise OutputLocationError(f"{directory}: cannot be an output directory, {base} is a file")
    if not is_writable(base):
        what = str(directory) if base == directory.absolute() else f"{base} (to create {directory})"
        raise OutputLocationError(f"{what}: not writable (read-only filesystem or no permission)")
    return directory


def check_output_file(path: Path, *, needed_bytes: int = 0) -> Path:
    """An output file path: its directory passes check_output_dir, no directory (or device, ...) sits at
    `path` (an existing regular file is replaced atomically), and `needed_bytes` fit on the disk."""
    path = Path(path)
    if path.exists() and not path.is_file():
        kind = "a directory" if path.is_dir() else "something other than a regular file"
        raise OutputLocationError(f"{path}: {kind} is in the way of the output file")
    check_output_dir(path.parent)
    check_free_space(path.parent, needed_bytes, what=str(path))
    return path


def check_free_space(directory: Path, needed_bytes: int, *, what: str) -> None:
    """Refuse when the filesystem of `directory` has fewer than `needed_bytes` free."""
    if needed_bytes <= 0:
        return
    free = free_bytes(existing_ancestor(directory))
    if free < needed_bytes:
        raise OutputLocationError(
            f"{what}: disk full: {describe_size(free)} free in {directory}, the output needs about "
            f"{describe_size(needed_bytes)}"
        )


def describe_size(size: int) -> str:
    """A byte count for people, in the unit that keeps it readable: '900 bytes', '5.3 KiB', '2.0 GiB'."""
    if size >= GIB:
        return f"{size / GIB:.1f} GiB"
    if size >= MIB:
        return f"{size / MIB:.1f} MiB"
    if size >= KIB:
        return f"{size / KIB:.1f} KiB"
    return f"{size} bytes"


def estimate_output_bytes(suffix: str, num_frames: int, height: int, width: int) -> int:
    """A rough lower bound of an output file's size, only to catch a disk that is clearly too full.

    .npy is exact (raw uint8 frames plus its header). .png and .mp4 compress by an amount that depends
    on the picture, so they get conservative floors: a tenth of the raw pixels for png, a fiftieth for
    H.264 at CRF 18, plus container overhead.
    """
    raw = num_frames * height * width * 3
    suffix = suffix.lower()
    if suffix == ".npy":
        return raw + 128
    if suffix == ".png":
        return raw // 10 + 1024
    return raw // 50 + 4096
