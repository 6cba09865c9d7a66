"""Shared helpers for the benchmark scripts: timing, peaks and floors, errors, tables, JSON, clocks, interrupts.

Plain functions, no state (GpuSampler holds only its own samples). A benchmark script imports what it
needs (`from bench_utils import timed`; scripts run as `python3 benchmarks/NAME.py`, which puts this
folder on sys.path) and answers one question with one table. The conventions every script follows:

- Timing: `timed(fn, device, warmup=, iters=)` -> (last output, first-call seconds, ms per timed
  call); CUDA events around each call on a GPU, perf_counter on CPU. Report the median.
- Floors: a workload's FLOPs at the peaks measured on the same machine in the same run
  (`matmul_peak`, `attention_peaks`, combined by `floor_ms`), never at datasheet numbers.
- Errors: `max_abs` / `relative_error` against a reference output; PSNR of uint8 frames is
  mmgen.render.metrics.psnr_uint8, an error's message on one line mmgen.errors.one_line.
- Report: `environment_header(device)` first (device, torch/CUDA/cuDNN and kernel-library
  versions), then the table (`print_table`); `write_json` keeps every number for RESULTS.md.
- Clocks: `GpuSampler()` samples every GPU's SM clock and power once a second (nvidia-smi) around a
  run; `summary(start, end, gpus)` gives a window's min / median clock and median power.
- Interrupts: `report_on_sigterm()` turns `timeout`'s SIGTERM into KeyboardInterrupt, so a script
  can print the rows it measured before a time limit ended it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from mmgen.attention import AttentionMetadata, SDPAImpl
from mmgen.errors import one_line
from mmgen.kernels.fa_providers import probe_provider as load_provider

# Distributions whose versions a benchmark result names (those installed are reported).
REPORTED_DISTRIBUTIONS = (
    "diffusers",
    "transformers",
    "triton",
    "fa3-fwd",
    "flash-attn-4",
    "nvidia-cutlass-dsl",
    "flashinfer-python",
)

# ----------------------------------------------------------------------------------------------
# timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup: int,
    iters: int,
    during: contextlib.AbstractContextManager | None = None,
) -> tuple:
    """(last output, first-call seconds, [ms of each timed call]); CUDA events on a GPU; `during` wraps the timed calls."""
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    first = time.perf_counter() - start
    for _ in range(warmup - 1):
        out = fn()
    times = []
    with during if during is not None else contextlib.nullcontext():
        out, times = _timed_calls(fn, device, iters, out)
    return out, first, times


def _timed_calls(fn: Callable[[], object], device: torch.device, iters: int, out: object) -> tuple:
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            out = fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            tick = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - tick) * 1e3)
    return out, times


def median_ms(fn: Callable[[], object], device: torch.device, *, warmup: int = 2, iters: int = 5) -> float:
    """Median ms of `iters` timed calls of fn after `warmup` untimed ones."""
    _, _, times = timed(fn, device, warmup=warmup, iters=iters)
    return statistics.median(times)


# ----------------------------------------------------------------------------------------------
# peaks and floors


def matmul_peak(device: torch.device, size: int) -> float:
    """bf16 [size]^3 matmul TFLOP/s on random data (median of 10)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
    return 2 * size**3 / (median_ms(lambda: a @ b, device, warmup=3, iters=10) * 1e-3) / 1e12


def attention_kernels(device: torch.device) -> dict[str, Callable]:
    """Dense attention callables q, k, v [B, S, H, D] -> out, by kernel name, that run here."""
    found: dict[str, Callable] = {}
    if device.type != "cuda":
        return {"sdpa": lambda q, k, v: SDPAImpl()(q, k, v, AttentionMetadata())}
    for name in ("fa3", "fa4"):
        provider = load_provider(name)
        if provider is not None:
            found[name] = lambda q, k, v, p=provider: p.flash_attn_func(
                q, k, v, softmax_scale=q.shape[-1] ** -0.5
            )
    found["cudnn"] = lambda q, k, v: _forced_sdpa(q, k, v, "cudnn")
    return found


def _sdpa_backend(kind: str):
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}[kind]


def _forced_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str) -> torch.Tensor:
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(_sdpa_backend(kind)):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


@contextlib.contextmanager
def sdpa_forced(kind: str | None) -> Iterator[None]:
    """torch SDPA restricted to one backend ("cudnn", "fa2"), or unchanged for None."""
    if kind is None:
        yield
        return
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(_sdpa_backend(kind)):
        yield


def attention_peaks(device: torch.device, shape: tuple[int, int, int, int]) -> dict[str, float | str]:
    """Self-attention TFLOP/s at `shape` [B, S, H, D] per kernel (or why it failed)."""
    batch, seq, heads, head_dim = shape
    flops = 4 * batch * heads * seq * seq * head_dim
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    peaks: dict[str, float | str] = {}
    for name, fn in attention_kernels(device).items():
        try:
            peaks[name] = flops / (median_ms(lambda fn=fn: fn(q, k, v), device) * 1e-3) / 1e12
        except Exception as err:  # report and go on: a kernel that fails here is skipped below too
            peaks[name] = one_line(err, typed=True)
    return peaks


def floor_ms(
    attention_flops: float, linear_flops: float, matmul_tflops: float, peaks: dict[str, float | str]
) -> dict[str, float | str]:
    """The time floor of a workload: attention FLOPs at the fastest measured attention kernel plus
    linear FLOPs at the measured matmul peak -> {ms, attention_ms, linear_ms, attention_kernel,
    attention_tflops, matmul_tflops} (peaks: attention_peaks' result; failed kernels are skipped)."""
    numeric = {k: v for k, v in peaks.items() if isinstance(v, float)}
    kernel = max(numeric, key=numeric.get) if numeric else "none"
    attention_tflops = numeric.get(kernel, float("nan"))
    floor: dict[str, float | str] = {
        "attention_kernel": kernel,
        "attention_tflops": attention_tflops,
        "matmul_tflops": matmul_tflops,
        "attention_ms": attention_flops / attention_tflops / 1e9,
        "linear_ms": linear_flops / matmul_tflops / 1e9,
    }
    floor["ms"] = floor["attention_ms"] + floor["linear_ms"]
    return floor


# ----------------------------------------------------------------------------------------------
# errors


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# ----------------------------------------------------------------------------------------------
# report


def versions() -> dict[str, str]:
    found = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    if torch.backends.cudnn.is_available():
        found["cudnn"] = str(torch.backends.cudnn.version())
    for dist in REPORTED_DISTRIBUTIONS:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def environment_header(device: torch.device) -> str:
    """One line: the device and every version that could change a figure."""
    return f"device {device_name(device)} | " + " | ".join(f"{k} {v}" for k, v in versions().items())


def print_table(columns: Sequence[tuple[str, int]], rows: Sequence[Sequence[object]]) -> None:
    """Columns (title, width; the first left-aligned, the rest right-aligned) and rows of cells.

    A float cell prints with 1 decimal (format it yourself for more), None as "-".
    """

    def cell(value: object, width: int, first: bool) -> str:
        text = "-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)
        return f"{text:<{width}}" if first else f"{text:>{width}}"

    print(" ".join(cell(title, width, i == 0) for i, (title, width) in enumerate(columns)))
    for row in rows:
        print(" ".join(cell(v, w, i == 0) for i, (v, (_, w)) in enumerate(zip(row, columns, strict=True))))


def write_json(path: Path | None, result: dict) -> None:
    """Every number of a run as JSON (path None: nothing); tensors and paths become strings."""
    if path is not None:
        path.write_text(json.dumps(result, indent=1, default=str))


RESULT = "@result "  # the line a script's fresh-process mode prints its JSON result on


def fresh_result(command: Sequence[str]) -> dict | None:
    """Run `command` (a script's own mode in a fresh process) to its end: the JSON after its RESULT line,
    or None (said, with its stderr's tail) when it printed none."""
    done = subprocess.run(list(command), capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if not lines:
        print(f"{' '.join(command[1:])}: failed\n{done.stderr[-2000:]}")
        return None
    return json.loads(lines[0].removeprefix(RESULT))


def fresh_rounds(
    runs: int, modes: Sequence[str], command: Callable[[str], list[str]], line: Callable[[dict], str]
) -> dict[str, list[dict]]:
    """Each mode's command(mode) in a fresh process once per round, the modes alternating within a round
    (a drift of the host hits each alike); each result printed as `run N MODE line(result)`. The results
    per mode (a failed run said and left out)."""
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    width = max(map(len, modes))
    for run in range(runs):
        for mode in modes:
            result = fresh_result(command(mode))
            if result is not None:
                results[mode].append(result)
                print(f"run {run + 1} {mode:<{width}} {line(result)}", flush=True)
    return results


def print_medians(title: str, values: dict[str, list[float]], width: int) -> None:
    """`title`, then per mode its median and each run's value (modes without one left out)."""
    print(f"\n{'mode':<{width}}  {title}")
    for mode, runs in values.items():
        if runs:
            print(f"{mode:<{width}}  {statistics.median(runs):6.3f}   {', '.join(f'{v:.3f}' for v in runs)}")


def report_on_sigterm() -> None:
    """`timeout` ends a run with SIGTERM: raise KeyboardInterrupt instead, so the script can print
    what it measured so far (catch KeyboardInterrupt around the measurements)."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def bench_device(tiny: bool) -> torch.device:
    """The device a script runs on, set up for a benchmark run: CUDA when present; without it only a
    --tiny smoke run may go on (SystemExit otherwise). Also installs report_on_sigterm()."""
    report_on_sigterm()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not tiny:
        raise SystemExit("no CUDA device: run on a GPU, or pass --tiny for a CPU smoke run")
    return device


# ----------------------------------------------------------------------------------------------
# GPU clocks and power


class GpuSampler:
    """nvidia-smi's SM clock (MHz) and power draw (W) of every GPU, sampled once every `period_s` on a
    background thread while in its `with` block: a sustained run on an H100 hits the power cap and
    clocks down, so a figure is read next to the clocks it ran at. No nvidia-smi: no samples."""

    QUERY = ("nvidia-smi", "--query-gpu=index,clocks.sm,power.draw", "--format=csv,noheader,nounits")

    def __init__(self, period_s: float = 1.0) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, int, float, float]] = []  # (monotonic s, gpu, MHz, W)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                out = subprocess.run(self.QUERY, capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.SubprocessError):
                return  # no nvidia-smi here: nothing to sample
            for line in out.splitlines():
                parts = [p.strip() for p in line.split(",")]
                try:
                    self.samples.append((now, int(parts[0]), float(parts[1]), float(parts[2])))
                except (ValueError, IndexError):
                    continue  # "[N/A]" on a GPU that does not report it
            self._stop.wait(self.period_s)

    def summary(self, start: float, end: float, gpus: Sequence[int]) -> dict[str, float | int | None]:
        """Samples of `gpus` between monotonic times start and end: min / median SM clock, median power."""
        window = [s for s in self.samples if start <= s[0] <= end and s[1] in gpus]
        if not window:
            return {"samples": 0, "clock_min_mhz": None, "clock_median_mhz": None, "power_median_w": None}
        return {
            "samples": len(window),
            "clock_min_mhz": min(s[2] for s in window),
            "clock_median_mhz": statistics.median(s[2] for s in window),
            "power_median_w": statistics.median(s[3] for s in window),
        }


def profiled_kernels(fn, device: torch.device) -> tuple[list, float]:
    """One call of fn under torch.profiler: (its kernel and copy events, one per name, the call's wall
    seconds). Only device events count: the CPU-side ops and annotations that carry their kernels'
    time (aten::, a custom op and its wrappers, record_param_comms) would count one kernel several times;
    so would the NCCL annotations ("nccl:all_to_all"), device events that span their ncclDevKernel."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        synchronize(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    return [e for e in events if e.device_type == DeviceType.CUDA and not e.key.startswith("nccl:")], wall


def print_kernels(events: list, top: int) -> None:
    """The `top` of profiled_kernels' events by device time, with their share of all."""
    total = sum(e.device_time_total for e in events) or 1
    for event in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        share = event.device_time_total / total
        print(
            f"  {event.device_time_total / 1e3:8.1f} ms {share:6.1%} x{event.count:<5} {event.key[:90]}",
            flush=True,
        )


def print_kernel_breakdown(fn, device: torch.device, *, top: int) -> None:
    """The `top` kernels by device time of one call of fn (after an unprofiled one), with their share."""
    fn()
    events, _ = profiled_kernels(fn, device)
    print(f"kernels of one call: {sum(e.device_time_total for e in events) / 1e3:.1f} ms device time")
    print_kernels(events, top)
