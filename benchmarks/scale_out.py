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

End-to-end mode (`--e2e STEPS`), the question "how long does one real job take on this layout": per
layout the group's start, a 1-step warm-up job (its seconds shown, `warm s`), then ONE job of STEPS
steps, timed on rank 0: `e2e s` (the whole call), `x e2e` (over 1 GPU's, this run's or --baseline's),
`text`, `denoise`, `s/step` (denoise / STEPS: a job's rate, its per-job denoise costs included),
`decode`, the frames sha256 against 1 GPU's, and the clocks over its denoise.

Random bf16 weights at the real configs, written on the GPU host first (`--make-random KIND DIR`:
wan13b, wan14b, a14b = Wan2.2-T2V-A14B's two 14B experts; a reduced UMT5 unless --text-encoder full).
`bash benchmarks/gpu_session.sh` runs them (cases scale_out, scale_out_14b_part1/2, a14b_e2e, a14b_e2e_u4;
their comments say how long), e.g. on 4 H100s:

    python3 benchmarks/scale_out.py --make-random wan13b /tmp/wan13b --steps 4,12 --json scale13b.json
    python3 benchmarks/scale_out.py --make-random a14b /tmp/a14b --size 1280x720 --e2e 40 \\
        --layouts cfg2xu2 --json a14b_e2e.json

CPU smoke runs of the harness (tiny random directories, gloo ranks): `--tiny`, `--tiny --e2e 4`,
`--tiny --make-random a14b DIR` (the tiny model of that kind, kept in DIR).
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
from wan_models import RANDOM_KINDS  # noqa: E402

from mmgen.executors.groups import LocalGroupsExecutor  # noqa: E402
from mmgen.executors.jobs import JobSpec, ModelSpec, RenderedJob  # noqa: E402
from mmgen.families import model_heads  # noqa: E402
from mmgen.parallel.layout import ParallelConfig  # noqa: E402
from mmgen.placement.policy import DECODE_MODES  # noqa: E402
from pipelines.request import GenerationRequest  # noqa: E402

# Layout names, in the order they run: 1, cfg2, u2, u4, u8, cfg2xu2, cfg2xu4 (uNrM: a ring of M).
DEFAULT_LAYOUTS = ("1", "cfg2", "u2", "u4", "u8", "cfg2xu2", "cfg2xu4")
SEQUENCE_PARALLEL = re.compile(r"(?:u(?P<sp>\d+)(?:r(?P<ring>\d+))?)?")
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
    start_s: float = 0.0  # run() called -> the first job's result, less that job's own seconds
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
            if len(run.jobs) == 1:  # the group's first job: what came before it is the group's start
                run.start_s = run.arrived[rendered.label] - began - run.seconds(rendered.label)
    except Exception as err:  # noqa: BLE001 - one layout failing (out of memory) leaves the others to run
        run.error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    run.load_s = executor.load_seconds
    return run


def denoise_window(run: LayoutRun, job: str) -> tuple[float, float]:
    """The monotonic times job's denoise ran (client clock; off by the frames' transfer, ~0.1 s)."""
    timings = run.jobs[job].timings
    began = run.arrived[job] - float(timings["render"]) + float(timings.get("text_encode", 0.0))
    return began, began + float(timings["denoise"])


def step_figures(run: LayoutRun, low: int, high: int) -> dict[str, Any]:
    """Steps mode: the steady per-step rate, the fixed cost per job, the first job's extra, the split."""
    rate = (run.seconds("high", "denoise") - run.seconds("low", "denoise")) / (high - low)
    row = {
        "first_job_extra_s": run.seconds("cold") - run.seconds("low"),
        "low_s": run.seconds("low"),
        "high_s": run.seconds("high"),
        "step_s": rate,
        "fixed_s": run.seconds("low") - low * rate,
        "sha_low": run.jobs["low"].frames_sha256,
    }
    if "split" in run.jobs:
        row["split_decode_s"] = run.seconds("split", "decode")
        row["split_same_bits"] = run.jobs["split"].frames_sha256 == row["sha_low"]
    return row


def e2e_figures(run: LayoutRun, steps: int) -> dict[str, Any]:
    """End-to-end mode: the one STEPS-step job's seconds on rank 0, after the 1-step warm-up job."""
    return {
        "warm_s": run.seconds("warm"),
        "e2e_s": run.seconds("e2e"),
        "denoise_s": run.seconds("e2e", "denoise"),
        "denoise_step_s": run.seconds("e2e", "denoise") / steps,
    }


def summarize(
    runs: list[LayoutRun], args: argparse.Namespace, sampler: GpuSampler, baseline: dict | None = None
) -> list[dict[str, Any]]:
    """Each layout's figures (see the module docstring). `speedup` (steps mode: per step; e2e mode: end to
    end) and `same_bits_as_1gpu` against the 1 GPU row: this run's, else `baseline` (an earlier run's)."""
    job = "e2e" if args.e2e else "high"  # the job whose frames, stages and clocks a row shows
    rows = []
    for run in runs:
        row: dict[str, Any] = {"layout": run.name, "gpus": run.config.world_size, "error": run.error}
        if run.error is None:
            row.update(
                load_s=run.load_s,
                start_s=run.start_s,
                text_encode_s=run.seconds(job, "text_encode"),
                decode_s=run.seconds(job, "decode"),
                sha=run.jobs[job].frames_sha256,
                clocks=sampler.summary(*denoise_window(run, job), range(run.config.world_size)),
            )
            row.update(e2e_figures(run, args.e2e) if args.e2e else step_figures(run, *args.steps))
        rows.append(row)
    rate = "e2e_s" if args.e2e else "step_s"
    base = next((r for r in rows if r["layout"] == "1" and r["error"] is None), baseline)
    for row in rows:
        if row["error"] is None:
            row["speedup"] = None if base is None else base[rate] / row[rate]
            row["same_bits_as_1gpu"] = None if base is None else row["sha"] == base["sha"]
    return rows


def _num(key: str, digits: int = 2) -> Any:
    return lambda row: None if row.get(key) is None else f"{row[key]:.{digits}f}"


def _clocks(row: dict) -> str | None:
    got = row.get("clocks") or {}
    if not got.get("samples"):
        return None
    return f"{got['clock_min_mhz']:.0f}/{got['clock_median_mhz']:.0f} {got['power_median_w']:.0f}W"


def _split(row: dict) -> str | None:
    if "split_decode_s" not in row:
        return None
    return f"{row['split_decode_s']:.2f} {'=' if row['split_same_bits'] else '!='}"


def _same(row: dict) -> str | None:
    same = row["same_bits_as_1gpu"]
    return None if same is None else ("yes" if same else "NO")


# Each mode's table: (title, width, the cell from a row).
LEAD = [
    ("layout", 8, lambda r: r["layout"]),
    ("gpus", 4, lambda r: r["gpus"]),
    ("start s", 7, _num("start_s", 1)),
]
TAIL = [("sha", 8, lambda r: r["sha"][:8]), ("=1gpu", 5, _same), ("MHz min/med W", 15, _clocks)]
STEP_COLUMNS = [
    *LEAD, ("1st +s", 6, _num("first_job_extra_s", 1)), ("s/step", 7, _num("step_s", 3)),
    ("x/step", 6, _num("speedup")), ("fixed s", 7, _num("fixed_s")), ("low s", 7, _num("low_s")),
    ("high s", 7, _num("high_s")), ("decode", 6, _num("decode_s")), ("split", 8, _split), *TAIL,
]  # fmt: skip
E2E_COLUMNS = [
    *LEAD, ("warm s", 6, _num("warm_s", 1)), ("e2e s", 7, _num("e2e_s")), ("x e2e", 5, _num("speedup")),
    ("text", 5, _num("text_encode_s")), ("denoise", 7, _num("denoise_s")),
    ("s/step", 6, _num("denoise_step_s", 3)), ("decode", 6, _num("decode_s")), *TAIL,
]  # fmt: skip


def print_rows(rows: list[dict[str, Any]], columns: list[tuple[str, int, Any]]) -> None:
    """One table: a row per layout; a failed layout shows its error (and prints it whole)."""
    table = []
    for row in rows:
        if row["error"] is not None:
            table.append([row["layout"], row["gpus"], *[None] * (len(columns) - 3), row["error"][:15]])
            print(f"{row['layout']}: {row['error']}")
        else:
            table.append([cell(row) for _, _, cell in columns])
    print_table([(title, width) for title, width, _ in columns], table)


def requests_for(args: argparse.Namespace, several: bool) -> dict[str, GenerationRequest]:
    """The layout's jobs, the same prompt and seed: steps mode cold, low, high (+ split on several
    GPUs); e2e mode a 1-step warm-up job, then the timed one of --e2e steps."""
    width, height = (int(v) for v in args.size.split("x"))

    def request(steps: int, **extra: Any) -> GenerationRequest:
        fields = {"decode": args.decode} if args.decode else {}
        return GenerationRequest(
            prompt=PROMPT,
            seed=args.seed,
            height=height,
            width=width,
            num_frames=args.frames,
            num_inference_steps=steps,
            guidance_scale=5.0,  # guided: CFG parallel has two branches to split
            **(fields | extra),
        )

    if args.e2e:
        return {"warm": request(1), "e2e": request(args.e2e)}
    low, high = args.steps
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
    parser.add_argument("--model", type=Path, help="a Wan T2V directory (diffusers format)")
    parser.add_argument("--make-random", nargs=2, metavar=("KIND", "DIR"), help="write a random bf16 "
                        f"directory first ({', '.join(RANDOM_KINDS)}) and use it; kept if DIR holds one; "
                        "with --tiny: the tiny model of KIND's layout")  # fmt: skip
    parser.add_argument("--text-encoder", choices=("reduced", "full"), default="reduced",
                        help="--make-random's text encoder (wan_models.TEXT_ENCODERS; full = UMT5-XXL)")  # fmt: skip
    parser.add_argument("--size", help="WIDTHxHEIGHT (default 832x480; --tiny 96x64)")
    parser.add_argument("--frames", type=int, help="frames, 4k + 1 (default 81; --tiny 9)")
    parser.add_argument("--steps", help="LOW,HIGH denoising steps (default 4,12; --tiny 2,4)")
    parser.add_argument("--e2e", type=int, metavar="STEPS", help="end-to-end mode: per layout a 1-step "
                        "warm-up job, then one timed job of STEPS steps (no low/high jobs)")  # fmt: skip
    parser.add_argument(
        "--layouts", default=",".join(DEFAULT_LAYOUTS), help="comma list (1, cfg2, uN, cfg2xuN, uNrM)"
    )
    parser.add_argument("--gpus", type=int, help="GPUs to use (default: all visible; --tiny: gloo ranks, 2)")
    parser.add_argument("--no-split", action="store_true", help="skip the split-decode job")
    parser.add_argument("--decode", choices=DECODE_MODES, help="every job's decode (default: the pipeline's, "
                        "full); e.g. split where the whole-frame decode does not fit beside the weights")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny random model, gloo ranks")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--baseline",
        type=Path,
        help="an earlier run's --json: its 1 GPU row (same model, mode, size, steps, seed) as the baseline",
    )
    args = parser.parse_args()
    args.size = args.size or ("96x64" if args.tiny else "832x480")
    args.frames = args.frames or (9 if args.tiny else 81)
    if args.e2e is not None:
        if args.steps is not None or args.e2e < 1:
            raise SystemExit(
                f"--e2e: one step count >= 1 and no --steps, got --e2e {args.e2e} --steps {args.steps}"
            )
    else:
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
        if args.tiny and args.make_random is None:
            shutil.rmtree(model, ignore_errors=True)


def measure(args: argparse.Namespace, model: Path, cuda: bool, gpus: int, baseline: dict | None) -> int:
    """Every layout, one after another; the table and the JSON."""
    spec = ModelSpec(model=str(model), device="cuda" if cuda else "cpu")
    print(environment_header(torch.device("cuda" if cuda else "cpu")))
    mode = f"e2e {args.e2e} steps" if args.e2e else f"steps {args.steps}"
    print(f"model {model} | {args.size}x{args.frames} | {mode} | {gpus} GPUs")
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
    rows = summarize(runs, args, sampler, baseline)
    print_rows(rows, E2E_COLUMNS if args.e2e else STEP_COLUMNS)
    write_json(args.json, {"args": vars(args), "environment": environment_header(torch.device(spec.device)),
                           "rows": rows})  # fmt: skip
    return 0 if all(r.error is None for r in runs) else 1


def baseline_row(args: argparse.Namespace) -> dict | None:
    """--baseline's 1 GPU row; refused when that run's mode, size, frames, steps, seed or decode differ."""
    if args.baseline is None:
        return None
    earlier = json.loads(args.baseline.read_text())
    for name in ("e2e", "size", "frames", "steps", "seed", "decode"):
        mine = getattr(args, name)
        if earlier["args"].get(name) != (list(mine) if isinstance(mine, tuple) else mine):
            raise SystemExit(
                f"--baseline: its {name} {earlier['args'].get(name)} differs from this run's {mine}"
            )
    row = next((r for r in earlier["rows"] if r["layout"] == "1" and r["error"] is None), None)
    if row is None:
        raise SystemExit(f"--baseline: {args.baseline} has no 1 GPU row")
    return row


def write_model(args: argparse.Namespace, device: str) -> Path:
    """The model directory: --model, a random one --make-random writes (or finds written; --tiny: the
    tiny model of its kind), or --tiny's own (a temporary Wan2.1-shaped one)."""
    from wan_models import dit_label, write_random_wan_dir

    if args.make_random is None:
        if args.tiny:
            directory = Path(tempfile.mkdtemp(prefix="mmgen-scale-tiny-"))
            write_random_wan_dir(directory, tiny=True, text_encoder="reduced", device="cpu")
            return directory
        if args.model is None:
            raise SystemExit("--model DIR or --make-random KIND DIR")
        return args.model
    kind, directory = args.make_random
    if kind not in RANDOM_KINDS:
        raise SystemExit(f"--make-random: {kind!r} is not one of {', '.join(RANDOM_KINDS)}")
    dit_size, two_experts = RANDOM_KINDS[kind]
    directory = Path(directory)
    written = directory / "random_weights.json"
    if written.exists():
        dit = json.loads(written.read_text())["dit"]
        if dit != dit_label(dit_size, two_experts=two_experts, tiny=args.tiny):
            raise SystemExit(f"--make-random {kind}: {directory} already holds {dit}; name another DIR")
    else:
        made = write_random_wan_dir(
            directory,
            tiny=args.tiny,
            text_encoder=args.text_encoder,
            device=device,
            dit_size=dit_size,
            two_experts=two_experts,
        )
        gib = sum(made["bytes"].values()) / 2**30
        print(f"wrote {made['dit']} + {made['text_encoder']} to {directory} ({gib:.1f} GiB) in "
              f"{made['seconds']:.1f} s", flush=True)  # fmt: skip
    return directory


if __name__ == "__main__":
    sys.exit(main())
