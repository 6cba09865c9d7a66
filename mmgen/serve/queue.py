"""The durable job queue of `mmgen serve`: one SQLite file (WAL, synchronous=FULL) under the state dir.

A job row is committed before POST returns. Jobs run FIFO (by insertion order). On start,
`recover()` re-queues jobs left `in_progress` by a crash (their seed is stored, so the re-run makes
the same frames) and re-checks every completed job's output against its recorded sha256 (a missing
or different file re-queues the job). One connection serves every thread, behind a lock: the HTTP
side only reads rows and inserts them, and each statement is short.

Statuses: queued -> in_progress -> completed | failed | cancelled; queued -> cancelled. A cancel of
a running job sets `cancel`; the worker stops between denoising steps and marks it cancelled.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmgen.outputs.writers import file_sha256

ID_PREFIXES = {"video": "video_", "image": "img_"}
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    kind TEXT NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    fields TEXT NOT NULL,
    options TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    completed_at REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    cancel INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    result TEXT,
    output TEXT,
    output_sha256 TEXT,
    upload TEXT
);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status, seq);
"""
UNFINISHED = ("queued", "in_progress")
# A job that was running this many times when the server died is not started again: it may be
# what kills the server (a restart loop would never end).
MAX_ATTEMPTS = 3


class QueueFull(Exception):
    """The queue holds max_queue unfinished jobs already."""


@dataclass(frozen=True)
class Job:
    """One row of the job table (JSON columns decoded)."""

    seq: int
    id: str
    kind: str
    status: str
    progress: int
    fields: dict[str, Any]
    options: dict[str, Any]
    created_at: float
    started_at: float | None
    completed_at: float | None
    attempts: int
    cancel: bool
    error: dict[str, Any] | None
    result: dict[str, Any] | None
    output: str | None
    output_sha256: str | None
    upload: str | None

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> Job:
        values = dict(row)
        for name in ("fields", "options", "error", "result"):
            values[name] = None if values[name] is None else json.loads(values[name])
        values["cancel"] = bool(values["cancel"])
        return cls(**values)


def new_job_id(kind: str) -> str:
    """A random, unguessable id: 'video_' or 'img_' and 32 hex digits."""
    return ID_PREFIXES[kind] + secrets.token_hex(16)


def valid_job_id(text: str, kind: str) -> bool:
    prefix = ID_PREFIXES[kind]
    rest = text.removeprefix(prefix)
    return text.startswith(prefix) and len(rest) == 32 and all(c in "0123456789abcdef" for c in rest)


class JobStore:
    """The job table in `path` (created if missing); every method is one short transaction."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        with self._lock:
            self._db.executescript(_SCHEMA)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- the HTTP side --

    def add(
        self,
        kind: str,
        fields: dict[str, Any],
        options: dict[str, Any],
        *,
        max_unfinished: int | None = None,
        job_id: str | None = None,
        upload: str | None = None,
    ) -> Job:
        """Insert a queued job and commit it; QueueFull if `max_unfinished` jobs are queued or running."""
        job_id = job_id or new_job_id(kind)
        with self._transaction() as db:
            if max_unfinished is not None:
                (unfinished,) = db.execute(
                    "SELECT COUNT(*) FROM jobs WHERE status IN (?, ?)", UNFINISHED
                ).fetchone()
                if unfinished >= max_unfinished:
                    raise QueueFull(f"{unfinished} jobs are queued or running (--max-queue {max_unfinished})")
            db.execute(
                "INSERT INTO jobs (id, kind, status, fields, options, created_at, upload) "
                "VALUES (?, ?, 'queued', ?, ?, ?, ?)",
                (job_id, kind, json.dumps(fields), json.dumps(options), time.time(), upload),
            )
        job = self.get(job_id)
        assert job is not None
        return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else Job.from_row(row)

    def page(self, kind: str, *, after: str | None, limit: int, order: str) -> tuple[list[Job], bool]:
        """Up to `limit` jobs of `kind` after the job `after` (by creation), 'asc' or 'desc'; and whether more follow."""
        compare, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        query = f"SELECT * FROM jobs WHERE kind = ? ORDER BY seq {direction} LIMIT ?"
        args: tuple[Any, ...] = (kind, limit + 1)
        if after is not None:
            query = (
                f"SELECT * FROM jobs WHERE kind = ? AND seq {compare} "
                f"(SELECT seq FROM jobs WHERE id = ?) ORDER BY seq {direction} LIMIT ?"
            )
            args = (kind, after, limit + 1)
        with self._lock:
            rows = self._db.execute(query, args).fetchall()
        return [Job.from_row(row) for row in rows[:limit]], len(rows) > limit

    def request_cancel(self, job_id: str) -> Job | None:
        """Cancel a queued job now; flag a running one (the worker stops it between steps)."""
        return self.cancel(job_id)[0]

    def cancel(self, job_id: str) -> tuple[Job | None, bool]:
        """request_cancel, and whether this call ended the job (it was queued: now cancelled)."""
        with self._transaction() as db:
            ended = db.execute(
                "UPDATE jobs SET status = 'cancelled', completed_at = ? WHERE id = ? AND status = 'queued'",
                (time.time(), job_id),
            ).rowcount
            db.execute("UPDATE jobs SET cancel = 1 WHERE id = ? AND status = 'in_progress'", (job_id,))
        return self.get(job_id), ended == 1

    def delete(self, job_id: str) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))

    def counts(self) -> dict[str, int]:
        """Jobs per status (every status of protocol.STATUSES present, 0 where none)."""
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        found = {status: count for status, count in rows}
        return {s: found.get(s, 0) for s in ("queued", "in_progress", "completed", "failed", "cancelled")}

    # -- the worker side --

    def claim(self) -> Job | None:
        """The oldest queued job, now in_progress (attempts + 1); None when nothing is queued."""
        with self._transaction() as db:
            row = db.execute("SELECT id FROM jobs WHERE status = 'queued' ORDER BY seq LIMIT 1").fetchone()
            if row is None:
                return None
            db.execute(
                "UPDATE jobs SET status = 'in_progress', started_at = ?, attempts = attempts + 1, "
                "progress = 0 WHERE id = ?",
                (time.time(), row["id"]),
            )
        return self.get(row["id"])

    def set_progress(self, job_id: str, progress: int) -> bool:
        """Record progress (0-100) of a running job; returns whether a cancel was asked for."""
        with self._transaction() as db:
            db.execute(
                "UPDATE jobs SET progress = ? WHERE id = ? AND status = 'in_progress'", (progress, job_id)
            )
            row = db.execute("SELECT cancel FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return row is None or bool(row["cancel"])

    def cancel_requested(self, job_id: str) -> bool:
        with self._lock:
            row = self._db.execute("SELECT cancel FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return row is None or bool(row["cancel"])

    def complete(self, job_id: str, result: dict[str, Any], output: str, output_sha256: str) -> bool:
        """Publish a finished job; False (and nothing recorded) if it was cancelled or deleted meanwhile."""
        with self._transaction() as db:
            done = db.execute(
                "UPDATE jobs SET status = 'completed', progress = 100, completed_at = ?, result = ?, "
                "output = ?, output_sha256 = ?, error = NULL "
                "WHERE id = ? AND status = 'in_progress' AND cancel = 0",
                (time.time(), json.dumps(result), output, output_sha256, job_id),
            ).rowcount
        return done == 1

    def finish(self, job_id: str, status: str, error: dict[str, Any] | None = None) -> None:
        """End a running job as 'failed' (with `error`) or 'cancelled'."""
        assert status in ("failed", "cancelled"), status
        with self._transaction() as db:
            db.execute(
                "UPDATE jobs SET status = ?, completed_at = ?, error = ? WHERE id = ? AND status = 'in_progress'",
                (status, time.time(), None if error is None else json.dumps(error), job_id),
            )

    def fail_interrupted(self, cause: str, since: float) -> list[str]:
        """After a server's process group failed (`cause`: one line naming the rank, from the
        launcher): each job it left in progress ends failed with server_error `cause` (cancelled if a
        cancel was asked), and a job the server already failed with server_error at or after `since`
        (time.time(); the group's own error, as a closed connection, reached it first) gets `cause`
        before its own message. Returns the ids of the jobs it ended or amended."""
        ended: list[str] = []
        with self._transaction() as db:
            rows = db.execute(
                "SELECT id, cancel, status, error FROM jobs WHERE status = 'in_progress' "
                "OR (status = 'failed' AND completed_at >= ?)",
                (since,),
            ).fetchall()
            for row in rows:
                error = json.loads(row["error"]) if row["error"] else {}
                if row["status"] == "failed":
                    if error.get("code") != "server_error" or error.get("message", "").startswith(cause):
                        continue
                    message = f"{cause}; then {error.get('message', '')}"
                    db.execute(
                        "UPDATE jobs SET error = ? WHERE id = ?",
                        (json.dumps({"code": "server_error", "message": message}), row["id"]),
                    )
                elif row["cancel"]:
                    db.execute(
                        "UPDATE jobs SET status = 'cancelled', completed_at = ? WHERE id = ?",
                        (time.time(), row["id"]),
                    )
                else:
                    db.execute(
                        "UPDATE jobs SET status = 'failed', completed_at = ?, error = ? WHERE id = ?",
                        (time.time(), json.dumps({"code": "server_error", "message": cause}), row["id"]),
                    )
                ended.append(row["id"])
        return ended

    def recover(self) -> dict[str, list[str]]:
        """At start: interrupted jobs queued again (cancelled if a cancel was asked, failed after
        MAX_ATTEMPTS), completed jobs' outputs checked (missing or changed: queued again). Returns
        the ids per action."""
        actions: dict[str, list[str]] = {"requeued": [], "cancelled": [], "failed": [], "reverified": []}
        crashed = json.dumps(
            {
                "code": "server_error",
                "message": f"the server stopped {MAX_ATTEMPTS} times while running this job",
            }
        )
        with self._transaction() as db:
            rows = db.execute("SELECT id, cancel, attempts FROM jobs WHERE status = 'in_progress'").fetchall()
            for row in rows:
                if row["cancel"]:
                    status, action = "cancelled", "cancelled"
                elif row["attempts"] >= MAX_ATTEMPTS:
                    status, action = "failed", "failed"
                else:
                    status, action = "queued", "requeued"
                db.execute(
                    "UPDATE jobs SET status = ?, progress = 0, started_at = NULL, error = ?, "
                    "completed_at = ? WHERE id = ?",
                    (status, crashed if status == "failed" else None,
                     None if status == "queued" else time.time(), row["id"]),
                )  # fmt: skip
                actions[action].append(row["id"])
            done = db.execute(
                "SELECT id, output, output_sha256 FROM jobs WHERE status = 'completed'"
            ).fetchall()
        for row in done:
            path = Path(row["output"] or "")
            if path.is_file() and file_sha256(path) == row["output_sha256"]:
                continue
            with self._transaction() as db:
                db.execute(
                    "UPDATE jobs SET status = 'queued', progress = 0, result = NULL, output = NULL, "
                    "output_sha256 = NULL, completed_at = NULL WHERE id = ?",
                    (row["id"],),
                )
            actions["reverified"].append(row["id"])
        return actions
