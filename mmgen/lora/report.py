"""The LoRA report: exactly what was applied, per file and per transformer (expert).

It goes into the result's args (in full), `generate`'s output (a line per file and expert), the
render manifest and the environment fingerprint (`identity()`: sha256, strength, experts and mode,
so `mmgen ab` refuses a pair whose LoRAs differ unless LoRAs are the declared variable).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

FIRST = 5  # how many names of a long list the report shows


@dataclass(frozen=True)
class ExpertReport:
    """One LoRA file on one transformer: keys applied, weights changed, keys that matched no weight."""

    expert: int
    matched: int
    weights: int
    not_matched: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "expert": self.expert,
            "matched": self.matched,
            "weights_changed": self.weights,
            "not_matched": len(self.not_matched),
            "not_matched_first": list(self.not_matched[:FIRST]),
        }


@dataclass(frozen=True)
class FileReport:
    """One LoRA file: identity, format, strength, experts, ranks/alphas/scales, ignored keys and why."""

    path: str
    sha256: str
    format: str
    strength: float
    experts: tuple[int, ...]
    keys: int
    ranks: tuple[int, ...]
    alphas: tuple[float | None, ...]
    scales: tuple[float, ...]
    ignored: tuple[tuple[str, str], ...]
    per_expert: tuple[ExpertReport, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "sha256": self.sha256,
            "format": self.format,
            "strength": self.strength,
            "experts": list(self.experts),
            "keys": self.keys,
            "ranks": list(self.ranks),
            "alphas": list(self.alphas),
            "scales": list(self.scales),
            "effective_scales": sorted({round(self.strength * s, 12) for s in self.scales}),
            "ignored": len(self.ignored),
            "ignored_reasons": dict(Counter(reason for _, reason in self.ignored)),
            "ignored_first": [key for key, _ in self.ignored[:FIRST]],
            "per_expert": [e.to_json() for e in self.per_expert],
        }


@dataclass(frozen=True)
class LoRAReport:
    """All LoRAs of one request: mode ('fused' | 'unfused'), allow_unmatched, one FileReport each."""

    mode: str
    allow_unmatched: bool
    files: tuple[FileReport, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "allow_unmatched": self.allow_unmatched,
            "files": [f.to_json() for f in self.files],
        }

    def identity(self) -> dict[str, Any]:
        """What decides the output bits: for the environment fingerprint and A/B checks."""
        return {
            "mode": self.mode,
            "files": [
                {"sha256": f.sha256, "strength": f.strength, "experts": list(f.experts)} for f in self.files
            ],
        }


EMPTY_REPORT = LoRAReport(mode="fused", allow_unmatched=False, files=())


def describe(report: dict[str, Any]) -> list[str]:
    """A LoRAReport's JSON (result.args['loras']) as one human line per file and expert."""
    lines = []
    for f in report["files"]:
        scales = ",".join(f"{s:g}" for s in f["effective_scales"]) or "-"
        head = (
            f"{f['path']} sha256 {f['sha256'][:16]} {f['format']} strength {f['strength']:g} "
            f"rank {','.join(map(str, f['ranks'])) or '-'} effective scale {scales}"
        )
        for e in f["per_expert"]:
            line = f"{head} expert {e['expert']}: {e['matched']}/{f['keys']} keys matched"
            if f["ignored"]:
                reasons = "; ".join(f"{n} {r}" for r, n in f["ignored_reasons"].items())
                line += f", {f['ignored']} ignored ({reasons})"
            if e["not_matched"]:
                line += f", {e['not_matched']} NOT matched (first: {', '.join(e['not_matched_first'])})"
            lines.append(line)
    return lines
