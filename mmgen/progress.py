"""Progress reporting for a generation: stages ("denoise", "decode", "export") of counted units.

The pipeline drives the "denoise" (one unit per step) and "decode" stages; whoever writes the files
(the CLI, a batch render) drives "export" on the same reporter. A reporter is passed in as a value,
so a batch render can show one bar per job under its own bar over jobs.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from mmgen.errors import ValidationError

STAGES = ("denoise", "decode", "export")


@runtime_checkable
class ProgressReporter(Protocol):
    """Receives stage starts and finished units. `stage` ends the previous stage, if any."""

    def stage(self, name: str, total: int) -> None: ...

    def advance(self, units: int = 1) -> None: ...

    def close(self) -> None: ...


class NullProgress:
    """A reporter that shows nothing (progress=False)."""

    def stage(self, name: str, total: int) -> None:
        pass

    def advance(self, units: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class TqdmProgress:
    """One tqdm line on stderr, reused across stages: its label names the stage, its count the units.

    position / leave / desc are tqdm's: a batch render puts its bar over jobs at position 0 and a
    per-job TqdmProgress(position=1, leave=False, desc="job 3") under it.
    """

    def __init__(self, *, desc: str = "", position: int | None = None, leave: bool = True) -> None:
        self._desc = desc
        self._position = position
        self._leave = leave
        self._bar = None

    def stage(self, name: str, total: int) -> None:
        label = f"{self._desc} {name}".strip()
        if self._bar is None:
            from tqdm import tqdm  # only when a bar is shown: `mmgen --help` and quiet runs skip it

            self._bar = tqdm(total=total, desc=label, position=self._position, leave=self._leave)
        else:
            self._bar.reset(total=total)
            self._bar.set_description(label)

    def advance(self, units: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(units)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def as_reporter(progress: bool | ProgressReporter) -> tuple[ProgressReporter, bool]:
    """The reporter for a `progress=` argument, and whether the callee owns it (and must close it)."""
    if progress is True:
        return TqdmProgress(), True
    if progress is False or progress is None:
        return NullProgress(), True
    if isinstance(progress, ProgressReporter):
        return progress, False
    raise ValidationError(
        f"progress: expected True, False or a ProgressReporter (stage/advance/close), got {type(progress).__name__}"
    )
