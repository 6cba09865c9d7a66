"""How does one Wan job scale over the GPUs of one host, per step and per job? (issue 38)

For every parallel layout N GPUs allow (1 GPU, CFG 2, Ulysses 2 / 4 / 8, CFG 2 x Ulysses 2 / 4;
`--layouts` picks), one after another, never two at once: the layout's group is started once (a
local group, as `mmgen render` / `generate --gpus` start one: spawned ranks, the model loaded on
each) and runs these jobs in order on the same group:

    cold   LOW steps   the group's first job: its start-up (NCCL set-up, first-call warm-ups) included
    low    LOW steps   the same job on a group that is up
    high   HIGH steps  the same request with more steps
    split  LOW steps   (several GPUs) the decode split over the ranks (`decode: split`), once

The per-step rate is (high - low) / (HIGH - LOW) on the denoise stage: the steady rate, free of
every per-job cost; the fixed cost per job is low's end-to-end seconds less LOW x that rate (text
encoding, the decode, the hand-out, anything paid per job, once the group is up). Columns: `start s`
the group's start (spawn, load, the groups' first collectives) until it takes its first job; `1st +s`
what the first job pays beyond a later one (cold - low); `s/step`, `x/step` (speed-up per step over
1 GPU), `fixed s`; `low s`, `high s` end to end on rank 0; `decode` (high's); `split` the split
decode's seconds and whether its frames equal the whole decode's (= / !=). The frames sha256
of every layout is compared with the 1 GPU layout's (same request, same seed), and split's with the
layout's own full decode. The SM clock and power of the layout's GPUs are sampled every second
(nvidia-smi) over high's denoise: a one-GPU run at the power cap clocks lower than ranks that wait
on collectives, which flatters the multi-GPU rows; the clocks say by how much.

Random bf16 weights at the real configs, written on the GPU host first (`--make-random`), e.g. on
4 H100s (~5 minutes at 1.3B 832x480x81):

    python3 benchmarks/scale_out.py --make-random wan13b /tmp/wan13b --steps 4,12 --json scale13b.json
    python3 benchmarks/scale_out.py --make-random wan14b /tmp/wan14b --size 1280x720 --steps 2,6 \\
        --layouts 1 --json /tmp/one14b.json                                  # ~7 min, then:
    python3 benchmarks/scale_out.py --model /tmp/wan14b --size 1280x720 --steps 2,6 \\
        --layouts u4,cfg2xu2 --baseline /tmp/one14b.json --json scale14b.json  # ~6 min

CPU smoke run of the harness (a tiny random directory, gloo ranks): `--tiny`.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from bench_utils import GpuSampler, environment_header, print_table, report_on_sigterm, write_json  # noqa: E402

from mmgen.executors.groups import LocalGroupsExecutor  # noqa: E402
from mmgen.executors.jobs import JobSpec, ModelSpec, RenderedJob  # noqa: E402
from mmgen.families import model_heads  # noqa: E402
from mmgen.parallel.layout import ParallelConfig  # noqa: E402
from pipelines.request import GenerationRequest  # noqa: E402

# Layout names, in the order they run: 1, cfg2, u2, u4, u8, cfg2xu2, cfg2xu4 (uNrM: a ring of M).
DEFAULT_LAYOUTS = ("1", "cfg2", "u2", "u4", "u8", "cfg2xu2", "cfg2xu4")
SEQUENCE_PARALLEL = re.compile(r"(?:u(?P<sp>\d+)(?:r(?P<ring>\d+))?)?")
RANDOM_DIRS = {"wan13b": "1.3b", "wan14b": "14b"}
PROMPT = "a red fox running through fresh snow, cinematic light"


def parse_layout(name: str) -> ParallelConfig:
    """'1', 'cfg2', 'u4', 'cfg2xu2', 'u4r2' (sp 4 as Ulysses 2 x ring 2) -> its ParallelConfig."""
    if name == "1":
        return ParallelConfig()
    cfg = name.startswith("cfg2")
    rest = name.removeprefix("cfg2").removeprefix("x") if cfg else name
    match = SEQUENCE_PARALLEL.fullmatch(rest)
    if match is None or (not cfg and not rest):
        raise SystemExit(f"--layouts: {name!r} is not a layout (1, cfg2, uN, cfg2xuN, uNrM)")
    return ParallelConfig(sp=int(match["sp"] or 1), ring=int(match["ring"] or 1), cfg=cfg)


@dataclass
class LayoutRun:
    """One layout's group, its jobs and what they measured."""

    name: str
    config: ParallelConfig
    jobs: dict[str, RenderedJob] = field(default_factory=dict)
    arrived: dict[str, float] = field(default_factory=dict)  # monotonic time each job reached the client
    start_s: float = 0.0  # run() called -> the cold job's result, less that job's own seconds
    load_s: float = 0.0
    error: str | None = None

    def seconds(self, job: str, stage: str = "render") -> float:
        return float(self.jobs[job].timings[stage])


def run_layout(
    spec: ModelSpec, name: str, config: ParallelConfig, requests: dict[str, GenerationRequest]
) -> LayoutRun:
    """Start the layout's group once and run `requests` on it in order; each job timed on rank 0."""
    run = LayoutRun(name, config)
    jobs = [JobSpec(i, label, request) for i, (label, request) in enumerate(requests.items())]
    executor = LocalGroupsExecutor(spec, config)
    began = time.monotonic()
    try:
        for rendered in executor.run(jobs):
            run.arrived[rendered.label] = time.monotonic()
            if not rendered.ok:
                raise RuntimeError(f"job {rendered.label}: {rendered.error}")
            run.jobs[rendered.label] = rendered
            if rendered.label == "cold":
                run.start_s = run.arrived["cold"] - began - run.seconds("cold")
    except Exception as err:  # noqa: BLE001 - one layout failing (out of memory) leaves the others to run
        run.error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    run.load_s = executor.load_seconds
    return run


def denoise_window(run: LayoutRun, job: str) -> tuple[float, float]:
    """The monotonic times job's denoise ran (client clock; off by the frames' transfer, ~0.1 s)."""
    timings = run.jobs[job].timings
    began = run.arrived[job] - float(timings["render"]) + float(timings.get("text_encode", 0.0))
    return began, began + float(timings["denoise"])


def summarize(
    runs: list[LayoutRun], low: int, high: int, sampler: GpuSampler, baseline: dict | None = None
) -> list[dict[str, Any]]:
    """Each layout's figures (see the module docstring); speed-ups against the 1 GPU layout's rate
    (this run's, else `baseline`: the 1 GPU row of an earlier run's JSON, same request)."""
    rows = []
    base = next((r for r in runs if r.name == "1" and r.error is None), None)
    base_rate, base_sha = (baseline["step_s"], baseline["sha_high"]) if baseline else (None, None)
    for run in runs:
        row: dict[str, Any] = {"layout": run.name, "gpus": run.config.world_size, "error": run.error}
        if run.error is None:
            rate = (run.seconds("high", "denoise") - run.seconds("low", "denoise")) / (high - low)
            row.update(
                load_s=run.load_s,
                start_s=run.start_s,
                first_job_extra_s=run.seconds("cold") - run.seconds("low"),
                low_s=run.seconds("low"),
                high_s=run.seconds("high"),
                step_s=rate,
                fixed_s=run.seconds("low") - low * rate,
                decode_s=run.seconds("high", "decode"),
                text_encode_s=run.seconds("high", "text_encode"),
                sha_low=run.jobs["low"].frames_sha256,
                sha_high=run.jobs["high"].frames_sha256,
                clocks=sampler.summary(*denoise_window(run, "high"), range(run.config.world_size)),
            )
            if "split" in run.jobs:
                row["split_decode_s"] = run.seconds("split", "decode")
                row["split_same_bits"] = run.jobs["split"].frames_sha256 == row["sha_low"]
            if run is base:
                base_rate, base_sha = rate, row["sha_high"]
            row["speedup_per_step"] = None if base_rate is None else base_rate / rate
            row["same_bits_as_1gpu"] = None if base_sha is None else row["sha_high"] == base_sha
        rows.append(row)
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    def num(row: dict, key: str, digits: int = 2) -> str | None:
        value = row.get(key)
        return None if value is None else f"{value:.{digits}f}"

    def clocks(row: dict) -> str | None:
        got = row.get("clocks") or {}
        if not got.get("samples"):
            return None
        return f"{got['clock_min_mhz']:.0f}/{got['clock_median_mhz']:.0f} {got['power_median_w']:.0f}W"

    def split(row: dict) -> str | None:
        if "split_decode_s" not in row:
            return None
        return f"{row['split_decode_s']:.2f} {'=' if row['split_same_bits'] else '!='}"

    columns = [
        ("layout", 8), ("gpus", 4), ("start s", 7), ("1st +s", 6), ("s/step", 7), ("x/step", 6),
        ("fixed s", 7), ("low s", 7), ("high s", 7), ("decode", 6), ("split", 8), ("sha", 8),
        ("=1gpu", 5), ("MHz min/med W", 15),
    ]  # fmt: skip
    table = []
    for row in rows:
        if row["error"] is not None:
            table.append([row["layout"], row["gpus"], *[None] * (len(columns) - 3), row["error"][:15]])
            print(f"{row['layout']}: {row['error']}")
            continue
        same = row["same_bits_as_1gpu"]
        table.append(
            [
                row["layout"], row["gpus"], num(row, "start_s", 1), num(row, "first_job_extra_s", 1),
                num(row, "step_s", 3), num(row, "speedup_per_step"), num(row, "fixed_s"), num(row, "low_s"),
                num(row, "high_s"), num(row, "decode_s"), split(row), row["sha_high"][:8],
                None if same is None else ("yes" if same else "NO"), clocks(row),
            ]
        )  # fmt: skip
    print_table(columns, table)


def requests_for(args: argparse.Namespace, several: bool) -> dict[str, GenerationRequest]:
    """The layout's jobs: cold, low, high (+ split on several GPUs); the same prompt and seed."""
    width, height = (int(v) for v in args.size.split("x"))
    low, high = args.steps

    def request(steps: int, **extra: Any) -> GenerationRequest:
        return GenerationRequest(
            prompt=PROMPT,
            seed=args.seed,
            height=height,
            width=width,
            num_frames=args.frames,
            num_inference_steps=steps,
            guidance_scale=5.0,  # guided: CFG parallel has two branches to split
            **extra,
        )

    jobs = {"cold": request(low), "low": request(low), "high": request(high)}
    if several and not args.no_split:
        jobs["split"] = request(low, decode="split")
    return jobs


def layouts_for(args: argparse.Namespace, gpus: int, heads: int | None) -> list[tuple[str, ParallelConfig]]:
    """The asked layouts that fit `gpus` and the model's heads (skipped ones are said, not silent)."""
    chosen = []
    for name in args.layouts.split(","):
        config = parse_layout(name.strip())
        if config.world_size > gpus:
            print(f"skipped {name}: {config.world_size} GPUs, {gpus} here")
        elif heads is not None and heads % config.ulysses:
            print(f"skipped {name}: {heads} heads do not split over Ulysses {config.ulysses}")
        else:
            chosen.append((name.strip(), config))
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="a Wan2.1-T2V directory (diffusers format)")
    parser.add_argument("--make-random", nargs=2, metavar=("KIND", "DIR"), help="write a random bf16 "
                        f"directory first ({', '.join(RANDOM_DIRS)}) and use it; kept if DIR holds one")  # fmt: skip
    parser.add_argument("--text-encoder", choices=("reduced", "full"), default="reduced",
                        help="--make-random's text encoder (wan_models.TEXT_ENCODERS; full = UMT5-XXL)")  # fmt: skip
    parser.add_argument("--size", help="WIDTHxHEIGHT (default 832x480; --tiny 96x64)")
    parser.add_argument("--frames", type=int, help="frames, 4k + 1 (default 81; --tiny 9)")
    parser.add_argument("--steps", help="LOW,HIGH denoising steps (default 4,12; --tiny 2,4)")
    parser.add_argument(
        "--layouts", default=",".join(DEFAULT_LAYOUTS), help="comma list (1, cfg2, uN, cfg2xuN, uNrM)"
    )
    parser.add_argument("--gpus", type=int, help="GPUs to use (default: all visible; --tiny: gloo ranks, 2)")
    parser.add_argument("--no-split", action="store_true", help="skip the split-decode job")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny random model, gloo ranks")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--baseline",
        type=Path,
        help="an earlier run's --json: its 1 GPU row (same model, size, steps, seed) as the baseline",
    )
    args = parser.parse_args()
    args.size = args.size or ("96x64" if args.tiny else "832x480")
    args.frames = args.frames or (9 if args.tiny else 81)
    args.steps = tuple(int(s) for s in (args.steps or ("2,4" if args.tiny else "4,12")).split(","))
    if len(args.steps) != 2 or not 1 <= args.steps[0] < args.steps[1]:
        raise SystemExit(f"--steps: two counts LOW,HIGH with 1 <= LOW < HIGH, got {args.steps}")
    baseline = baseline_row(args)  # checked before anything runs
    report_on_sigterm()
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        raise SystemExit("no CUDA device: run on GPUs, or pass --tiny for a CPU smoke run")
    gpus = args.gpus or (torch.cuda.device_count() if cuda else 2)
    model = write_model(args, "cuda" if cuda else "cpu")
    try:
        return measure(args, model, cuda, gpus, baseline)
    finally:
        if args.tiny:
            shutil.rmtree(model, ignore_errors=True)


def measure(args: argparse.Namespace, model: Path, cuda: bool, gpus: int, baseline: dict | None) -> int:
    """Every layout, one after another; the table and the JSON."""
    spec = ModelSpec(model=str(model), device="cuda" if cuda else "cpu")
    print(environment_header(torch.device("cuda" if cuda else "cpu")))
    print(f"model {model} | {args.size}x{args.frames} | steps {args.steps} | {gpus} GPUs")
    runs: list[LayoutRun] = []
    with GpuSampler() as sampler:
        try:
            for name, config in layouts_for(args, gpus, model_heads(model)):
                tick = time.perf_counter()
                runs.append(run_layout(spec, name, config, requests_for(args, config.world_size > 1)))
                print(f"{name}: {time.perf_counter() - tick:.1f} s{'' if runs[-1].error is None else ' FAILED'}",
                      flush=True)  # fmt: skip
        except KeyboardInterrupt:
            print("interrupted: the layouts measured so far")
    rows = summarize(runs, *args.steps, sampler, baseline)
    print_rows(rows)
    write_json(args.json, {"args": vars(args), "environment": environment_header(torch.device(spec.device)),
                           "rows": rows})  # fmt: skip
    return 0 if all(r.error is None for r in runs) else 1


def baseline_row(args: argparse.Namespace) -> dict | None:
    """--baseline's 1 GPU row; refused when that run's size, frames, steps or seed differ from this one's."""
    if args.baseline is None:
        return None
    earlier = json.loads(args.baseline.read_text())
    for name in ("size", "frames", "steps", "seed"):
        if earlier["args"][name] != (list(args.steps) if name == "steps" else getattr(args, name)):
            raise SystemExit(f"--baseline: its {name} {earlier['args'][name]} differs from this run's")
    row = next((r for r in earlier["rows"] if r["layout"] == "1" and r["error"] is None), None)
    if row is None:
        raise SystemExit(f"--baseline: {args.baseline} has no 1 GPU row")
    return row


def write_model(args: argparse.Namespace, device: str) -> Path:
    """The model directory: --model, a random one --make-random writes (or finds written), or --tiny's."""
    from wan_models import write_random_wan_dir

    if args.tiny:
        directory = Path(tempfile.mkdtemp(prefix="mmgen-scale-tiny-"))
        write_random_wan_dir(directory, tiny=True, text_encoder="reduced", device="cpu")
        return directory
    if args.make_random is None:
        if args.model is None:
            raise SystemExit("--model DIR or --make-random KIND DIR")
        return args.model
    kind, directory = args.make_random
    if kind not in RANDOM_DIRS:
        raise SystemExit(f"--make-random: {kind!r} is not one of {', '.join(RANDOM_DIRS)}")
    directory = Path(directory)
    written = directory / "random_weights.json"
    if written.exists():
        dit = json.loads(written.read_text())["dit"]
        if dit != f"Wan2.1-T2V-{RANDOM_DIRS[kind].upper()}":
            raise SystemExit(f"--make-random {kind}: {directory} already holds {dit}; name another DIR")
    else:
        made = write_random_wan_dir(
            directory, text_encoder=args.text_encoder, device=device, dit_size=RANDOM_DIRS[kind]
        )
        print(f"wrote {made['dit']} + {made['text_encoder']} to {directory} in {made['seconds']:.1f} s")
    return directory


if __name__ == "__main__":
    sys.exit(main())
