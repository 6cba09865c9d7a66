"""manifest.jsonl: one JSON object a line, appended once per finished (or failed) job.

The manifest is append-only history: the latest record for a request key is that job's state. An
append is one write of a complete line followed by fsync; when that write fails or is short (a full
disk), the file is truncated back to its old length, so a failed append leaves no partial line. Only a
kill (or power loss) in the middle of the write can leave one; `repair_manifest` drops such a line
(rewriting the file atomically) before a run appends again, and the run says that it did.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path
from typing import Any

from mmgen.outputs.writers import atomic_write_text, file_sha256, reporting_os_errors

MANIFEST_NAME = "manifest.jsonl"
# 2: "request" is the job's whole GenerationRequest.record() and "settings" the file's run settings
# (1 held only the fields the file set); readers take both (runner.changed_fields).
RECORD_SCHEMA = 2


def encode_record(record: dict[str, Any]) -> str:
    """One manifest line (no newline); values JSON lacks (paths, dtypes) are written as strings."""
    return json.dumps(record, sort_keys=True, default=str, allow_nan=True)


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append one record as a complete line and fsync it, or raise OutputWriteError leaving the file as it was."""
    line = (encode_record(record) + "\n").encode("utf-8")
    with reporting_os_errors(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            _append_or_give_back(fd, line)
        finally:
            os.close(fd)


def _append_or_give_back(fd: int, line: bytes) -> None:
    """Write `line` whole and fsync it; on any OSError cut the file back to its old length and re-raise."""
    size = os.fstat(fd).st_size  # the render lock makes this process the only writer
    try:
        written = write_once(fd, line)
        if written != len(line):
            raise OSError(errno.ENOSPC, f"short write ({written} of {len(line)} bytes)")
        os.fsync(fd)
    except OSError:
        with contextlib.suppress(OSError):  # give back the partial line; a kill here is repaired later
            os.ftruncate(fd, size)
            os.fsync(fd)
        raise


def write_once(fd: int, data: bytes) -> int:
    """One os.write (a seam: tests make it fail or write short to simulate a full disk)."""
    return os.write(fd, data)


def _parse_lines(text: str) -> tuple[list[dict[str, Any]], int]:
    records, dropped = [], 0
    for line in text.splitlines(keepends=True):
        try:
            obj = json.loads(line) if line.endswith("\n") else None
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            records.append(obj)
        elif line.strip():
            dropped += 1
    return records, dropped


def read_manifest(path: Path) -> list[dict[str, Any]]:
    """Every complete record, in file order; a partial or corrupt line is skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return _parse_lines(text)[0]


def repair_manifest(path: Path) -> int:
    """Drop partial/corrupt lines (a kill mid-append); returns how many were dropped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return 0
    records, dropped = _parse_lines(text)
    if dropped or (text and not text.endswith("\n")):
        atomic_write_text(path, "".join(encode_record(r) + "\n" for r in records))
    return dropped


def latest_by_key(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The latest record of each request key."""
    latest: dict[str, dict[str, Any]] = {}
    for record in records:
        key = record.get("request_key")
        if isinstance(key, str):
            latest[key] = record
    return latest


def outputs_intact(record: dict[str, Any], directory: Path) -> bool:
    """True when every output a record lists exists in `directory` with the recorded byte hash."""
    outputs = record.get("outputs")
    if not isinstance(outputs, list) or not outputs:
        return False
    for output in outputs:
        if not isinstance(output, dict) or not isinstance(output.get("path"), str):
            return False
        file = directory / output["path"]
        if not file.is_file() or file_sha256(file) != output.get("sha256"):
            return False
    return True
