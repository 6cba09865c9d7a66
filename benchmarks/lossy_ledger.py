"""The quality ledger's table (RESULTS.md 12a'): one row per `mmgen ab` comparison directory.

Run on CPU after the comparisons (benchmarks/lossy_ledger.yaml says how: one baseline render,
reused by every candidate):

    python3 benchmarks/lossy_ledger.py ab/ledger-*        # each DIR holds ab_report.json

Printed per DIR: the candidate's settings, DiT batch rows run (2 per guided step, 1 per CFG-truncated
step, 0 per cached step; of 2 x steps), PSNR mean and worst job, SSIM mean, and the prompt-following
score (the detector's fraction of named attributes read back, mean over the jobs) of baseline and
candidate, with the count of jobs whose colour and direction are both read back. Times are left out:
CPU timings on shared cores say nothing about the GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench_utils import print_table  # noqa: E402

from pipelines.step_cache import guided_steps  # noqa: E402


def steps_of(directory: Path, label: str) -> int:
    """Job `label`'s step count, from its latest record in the candidate's manifest."""
    steps = None
    with open(directory / "candidate" / "manifest.jsonl") as manifest:
        for line in manifest:
            record = json.loads(line)
            if record["job"]["label"] == label and record.get("status") == "ok":
                steps = int(record["args"]["num_inference_steps"])
    if steps is None:
        raise SystemExit(f"{directory}: no finished record of job {label!r} in candidate/manifest.jsonl")
    return steps


def ledger_row(directory: Path) -> tuple:
    report = json.loads((directory / "ab_report.json").read_text())
    jobs = [job for job in report["jobs"] if "error" not in job]
    steps = steps_of(directory, jobs[0]["job"])
    rows = []
    for job in jobs:
        lossy = job.get("candidate_lossy", {})
        reused = set(lossy.get("step_cache_reused", ()))
        keep = guided_steps(lossy.get("cfg_truncation"), steps)
        rows.append(sum(0 if i in reused else (2 if i < keep else 1) for i in range(steps)))
    psnrs = [job["psnr"] for job in jobs if job.get("psnr") is not None]

    def following(side: str) -> str:
        answers = [job["prompt_following"][side] for job in jobs if "prompt_following" in job]
        if not answers:
            return "-"
        both = sum(bool(a.get("colour_and_direction")) for a in answers)
        return f"{statistics.mean(a['score'] for a in answers):.3f} ({both}/{len(answers)})"

    dit_rows = f"{min(rows)}-{max(rows)}" if min(rows) != max(rows) else str(rows[0])
    return (
        " ".join(report.get("candidate_sets", [])) or report["candidate"],
        f"{dit_rows} of {2 * steps}",
        f"{statistics.mean(psnrs):.2f} / {min(psnrs):.2f}" if psnrs else "SHA-equal",
        f"{statistics.mean(job['ssim'] for job in jobs):.4f}",
        f"{following('base')} / {following('candidate')}",
        str(len(jobs)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="mmgen ab output directories")
    args = parser.parse_args()
    print_table(
        [
            ("candidate", 40),
            ("DiT rows", 10),
            ("PSNR mean / worst dB", 20),
            ("SSIM mean", 9),
            ("prompt-following base / candidate", 33),
            ("jobs", 4),
        ],
        [ledger_row(directory) for directory in args.dirs],
    )


if __name__ == "__main__":
    main()
