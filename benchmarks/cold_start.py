"""Cold start of `mmgen generate`: where the seconds go before the first frame, in fresh processes.

    python3 benchmarks/cold_start.py                                   # the default model, CPU
    python3 benchmarks/cold_start.py --model DIR --device cuda         # a model directory on a GPU
    python3 benchmarks/cold_start.py --write wan-1.3b --model DIR --device cuda   # write DIR first
    python3 benchmarks/cold_start.py --model DIR --device cuda --gpus 1,2         # + `--gpus N` rows

--write makes DIR a random-weight model directory at a real size (skipped when DIR already holds
one): wan-1.3b / wan-14b = Wan2.1-T2V's DiT + UMT5-XXL + the Wan2.1 VAE (benchmarks/wan_models.py;
28 GB on disk for 14B), qwen-image = Qwen-Image's 20B transformer + Qwen2.5-VL-7B + its VAE with the
tests' tiny tokenizer (~58 GB: give the machine the disk). Every run is a fresh interpreter, so the
imports are cold; one untimed run first puts the weights in the page cache ("from the page cache").

Table 1, one row per run (each column: seconds):
  start       interpreter start until this script's first line (python + site)
  torch       `import torch`
  mmgen       mmgen's and pipelines' modules the command imports (the CLI, the request, the loader)
  libraries   the diffusers / transformers classes the directory's loader imports (VAE, scheduler,
              Qwen-Image's text encoder; none for a Wan text-to-video directory, whose scheduler and
              VAE decoder are mmgen's), imported here first so the load columns hold no imports
  config      model_index.json and the components' configs, the default model's cache check
  weights     mmgen's loaders: checkpoint reads + copies to the device (load_into_module), GB/s over
              the safetensors bytes outside vae/
  vae, sched  the VAE's and the scheduler's loaders (mmgen's or diffusers' from_pretrained / from_config,
              + the copy to the device)
  text lib    transformers' from_pretrained of Qwen-Image's text encoder (Qwen only)
  other       the rest of load_pipeline (module construction, pipeline set-up)
  text, step, decode   the first call (one denoising step; two for Qwen-Image, whose terminal shift
              refuses one): text encoding, the step(s), the VAE decode
  total       interpreter start to the decoded frames
The load columns are measured under cProfile (which slows Python-heavy code, e.g. diffusers'
from_pretrained); "load" is their sum. Table 2 is the real command, `mmgen generate PROMPT --out F`
(+ --model, --device, --gpus N, --steps: default the model's, with --model the first call's), wall
seconds from the shell: min and median of --runs; then each run split by its `seconds:` line, "exit etc."
(the rest before its result lines came out: the interpreter's start before main, hand-overs between stages)
and "ended" (from the lines' arrival, flushed just before the command ends, to its end: its teardown).
"""

from __future__ import annotations

import time

STARTED = time.time()  # noqa: E402 - before every import: the interpreter's start is measured up to here

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

from checkout import checkout_pythonpath  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "a red circle moves right on a black background"
WRITERS = ("wan-1.3b", "wan-14b", "qwen-image")
LOAD_PARTS = {  # column -> functions (file suffix, name) whose cumulative time it is
    "weights": (("safetensors_dir.py", "load_into_module"), ("safetensors_dir.py", "read_tensors")),
    "vae": (("diffusers_dir.py", "load_vae"), ("qwen_image_dir.py", "load_qwen_vae")),
    "sched": (("diffusers_dir.py", "load_scheduler"),),
    "text lib": (("qwen_image_dir.py", "load_qwen_vl_model"),),
}
COLUMNS = ("start", "torch", "mmgen", "libraries", "config", "weights", "vae", "sched", "text lib", "other")
FIRST_CALL = ("text", "step", "decode")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="model directory (default: the embedded default model)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=None, help="default: fp32 on cpu, bf16 on cuda (as the CLI)")
    parser.add_argument("--write", choices=WRITERS, help="write random weights into --model first")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per table row (default 3)")
    parser.add_argument("--gpus", default="", help="comma list of GPU counts for table 2 (e.g. 1,2)")
    parser.add_argument("--steps", type=int, help="table 2's steps (default: the model's; 1 with --model)")
    parser.add_argument("--size", nargs=3, type=int, metavar=("H", "W", "F"), help="height width frames")
    parser.add_argument("--no-cli", action="store_true", help="table 1 only")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    parser.add_argument(
        "--profile-first-call",
        type=int,
        default=0,
        metavar="N",
        help="table 1's first call under cProfile: print its N functions of the most own time (slows it)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: one measured run
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(measure_once(args, float(args.child))))
        return
    if args.write:
        if args.model is None:
            parser.error("--write needs --model DIR (where to write)")
        write_model(args.write, args.model, args.device)
    report(args)


# ----------------------------------------------------------------------------------------------
# one fresh process


def measure_once(args: argparse.Namespace, spawned: float) -> dict:
    """Table 1's columns for one run of this interpreter (see the module docstring)."""
    row = {"start": STARTED - spawned}
    tick = time.perf_counter()
    import torch

    row["torch"] = _lap(tick)
    tick = time.perf_counter()
    import mmgen.cli  # noqa: F401
    import mmgen.executors.in_process  # noqa: F401
    import mmgen.executors.launch  # noqa: F401
    import pipelines.loader as loader
    import pipelines.request  # noqa: F401
    from mmgen.families import load_pipeline, makes_images

    row["mmgen"] = _lap(tick)
    tick = time.perf_counter()
    directory = loader.model_directory(args.model)  # the default model: built or checked here
    row["config"] = _lap(tick)
    tick = time.perf_counter()
    row["library_classes"] = import_model_libraries(directory)
    row["libraries"] = _lap(tick)

    device = loader.resolve_device(args.device)
    dtype = loader.resolve_dtype(args.dtype or "auto", device)
    image = makes_images(directory)
    pipe, load = profiled(
        lambda: load_pipeline(directory, task="t2i" if image else "t2v", device=device, dtype=dtype)
    )
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    row.update(load)
    row["weight_bytes"] = sum(
        f.stat().st_size
        for f in directory.rglob("*.safetensors")
        if "vae" not in f.relative_to(directory).parts
    )
    height, width, frames = args.size or (None, None, None)
    request = pipelines.request.GenerationRequest(
        prompt=PROMPT,
        num_inference_steps=first_steps(image),
        seed=0,
        height=height,
        width=width,
        num_frames=1 if image else frames,
    )
    if args.profile_first_call:
        result, row["first_call_top"] = top_functions(
            lambda: pipe.generate(request, progress=False), args.profile_first_call
        )
    else:
        result = pipe.generate(request, progress=False)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    timings = result.timings
    row.update(text=timings.get("text_encode", 0.0), step=timings.get("denoise", 0.0))
    row["decode"] = timings.get("decode", 0.0)
    row["total"] = time.time() - spawned
    row["versions"] = versions(torch)
    row["device_name"] = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    return row


def first_steps(image: bool) -> int:
    """Steps of the first call: 1; 2 for Qwen-Image (its shift_terminal makes a 1-step schedule NaN)."""
    return 2 if image else 1


def import_model_libraries(directory: Path) -> list[str]:
    """Import the diffusers / transformers classes the directory's loader will import; their names.

    A Wan text-to-video directory's flow UniPC scheduler and Wan2.1 VAE are mmgen's own (no library)."""
    import importlib

    from mmgen.loading.diffusers_dir import decodes_only
    from mmgen.loading.safetensors_dir import read_json
    from mmgen.models import wan_vae
    from mmgen.schedulers import unipc_flow

    path = directory / "model_index.json"
    index = json.loads(path.read_text()) if path.exists() else {}
    wanted = ["vae", "scheduler"]
    if _is_image_model(directory):
        wanted.append("text_encoder")  # transformers' Qwen2.5-VL (mmgen's own UMT5 for Wan)
    own = set()
    if index and not _is_image_model(directory):
        if unipc_flow.fits(read_json(directory / "scheduler" / "scheduler_config.json")):
            own.add("scheduler")
        if decodes_only(directory, index) and wan_vae.fits(read_json(directory / "vae" / "config.json")):
            own.add("vae")
    names = []
    for component in wanted:
        library, cls = index.get(component) or (None, None)
        if library in ("diffusers", "transformers") and component not in own:
            getattr(importlib.import_module(library), cls)
            names.append(f"{library}.{cls}")
    # An original Wan layout (no index): the scheduler and a t2v VAE are mmgen's; an i2v / vace VAE's
    # diffusers import then counts in the vae column.
    return names


def profiled(load) -> tuple[object, dict[str, float]]:
    """load() under cProfile; its seconds split into the LOAD_PARTS columns, config and other."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    tick = time.perf_counter()
    result = profile.runcall(load)
    total = time.perf_counter() - tick
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    parts = {}
    for column, functions in LOAD_PARTS.items():
        parts[column] = sum(
            entry[3]
            for key, entry in stats.items()
            if any(key[0].endswith(f) and key[2] == n for f, n in functions)
        )
    # config files read outside the VAE and scheduler loaders (those count in their own columns)
    inside = {n for f, n in LOAD_PARTS["vae"] + LOAD_PARTS["sched"]}
    config = 0.0
    for key, entry in stats.items():
        if key[0].endswith("safetensors_dir.py") and key[2] == "read_json":
            config += sum(edge[3] for caller, edge in entry[4].items() if caller[2] not in inside)
    parts["config_load"] = config
    parts["load"] = total
    parts["other"] = total - config - sum(parts[c] for c in LOAD_PARTS)
    return result, parts


def top_functions(call, count: int) -> tuple[object, list[tuple[str, float, float]]]:
    """call() under cProfile; its `count` functions of the most own time: (where, own s, cumulative s)."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    result = profile.runcall(call)
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    ranked = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:count]
    top = [(_where(key), entry[2], entry[3]) for key, entry in ranked]
    # who called the first three (by the own time each caller accounts for): an import compiling
    # sources and an ast.parse both show as builtins.compile
    for key, _ in ranked[:3]:
        top += _callers(stats, key, depth=3)
    return result, top


def _callers(stats: dict, key: tuple, depth: int, indent: str = "  ") -> list[tuple[str, float, float]]:
    """key's three callers of the most cumulative time in it, and theirs, `depth` levels up."""
    if depth == 0 or key not in stats:
        return []
    found = []
    for caller, times in sorted(stats[key][4].items(), key=lambda item: item[1][3], reverse=True)[:3]:
        found.append((f"{indent}<- {_where(caller)}", times[2], times[3]))
        found += _callers(stats, caller, depth - 1, indent + "  ")
    return found


def _where(key: tuple) -> str:
    """A pstats key (file, line, name) as file:line(name), the file's last two parts."""
    return f"{'/'.join(Path(key[0]).parts[-2:])}:{key[1]}({key[2]})"


def versions(torch) -> dict[str, str]:
    import importlib.metadata

    found = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "bytecode": bytecode_caching(torch),
    }
    for dist in ("diffusers", "transformers", "safetensors"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def bytecode_caching(torch) -> str:
    """Whether imports read compiled bytecode (torch's, as a sample): the lent GPU hosts set
    PYTHONDONTWRITEBYTECODE=1 over a torch installed without __pycache__, so every import there compiles
    its module's source (~2-3 s of torch's import and of the first call's lazy imports), which a pip
    install (bytecode compiled at install) does not pay."""
    import importlib.util

    cached = Path(importlib.util.cache_from_source(torch.__file__)).exists()
    written = "not written" if sys.dont_write_bytecode else "written"
    return f"{'read' if cached else 'compiled at import'} ({written}, prefix {sys.pycache_prefix})"


def _lap(tick: float) -> float:
    return time.perf_counter() - tick


# ----------------------------------------------------------------------------------------------
# the parent: fresh processes, tables


def child_run(args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--device", args.device]
    for flag, value in (("--model", args.model), ("--dtype", args.dtype)):
        if value is not None:
            command += [flag, str(value)]
    if args.size:
        command += ["--size", *map(str, args.size)]
    if args.profile_first_call:
        command += ["--profile-first-call", str(args.profile_first_call)]
    command += ["--child", repr(time.time())]  # the spawn time: the child's "start" column
    done = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"cold_start child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cli_wall(
    args: argparse.Namespace, gpus: int | None, root: Path = ROOT
) -> tuple[float, dict[str, float], str]:
    """One fresh `mmgen generate` of the checkout at `root`: its wall seconds, its `seconds:` line (rank
    0's start, load and stages, + "ended") and its frames' sha256."""
    image = args.model is not None and _is_image_model(args.model)  # Qwen-Image: a .png
    out = Path(tempfile.mkdtemp(prefix="mmgen-cold-")) / ("x.png" if image else "x.mp4")
    command = [sys.executable, "-m", "mmgen.cli", "generate", PROMPT, "--out", str(out)]
    command += ["--device", args.device]
    if args.model is not None:
        command += ["--model", str(args.model), "--steps", str(args.steps or first_steps(image))]
    elif args.steps:
        command += ["--steps", str(args.steps)]
    if args.dtype:
        command += ["--dtype", args.dtype]
    if args.size:
        command += ["--height", str(args.size[0]), "--width", str(args.size[1])]
        command += [] if image else ["--frames", str(args.size[2])]
    if gpus is not None:
        command += ["--gpus", str(gpus)]
    tick = time.perf_counter()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(root), cwd=root
    )
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.append(process.stderr.read()))
    reader.start()
    lines, printed = [], 0.0
    for line in process.stdout:  # piped: the lines arrive when the command flushes them, just before it ends
        printed = printed or time.perf_counter() - tick
        lines.append(line.rstrip("\n"))
    process.wait()
    wall = time.perf_counter() - tick
    reader.join()
    shutil.rmtree(out.parent, ignore_errors=True)
    if process.returncode != 0:
        sys.exit(f"mmgen generate failed:\n{errors[0][-3000:]}")
    line = next(x for x in lines if x.startswith("seconds: "))
    parts = [item.rsplit(" ", 1) for item in line.removeprefix("seconds: ").split(", ")]
    sha = next(x for x in lines if x.startswith("frames_sha256: ")).split()[-1]
    # ended: from its lines' arrival to its exit (the process's teardown, seen from outside)
    return wall, {**{name: float(value) for name, value in parts}, "ended": wall - printed}, sha


def report(args: argparse.Namespace) -> None:
    child_run(args)  # untimed: the weights into the page cache, the default model built
    rows = [child_run(args) for _ in range(args.runs)]
    first = rows[0]
    print(f"device {first['device_name']} | " + " | ".join(f"{k} {v}" for k, v in first["versions"].items()))
    print(
        f"model {args.model or 'default (embedded)'} | libraries {', '.join(first['library_classes']) or '-'}"
    )
    print(f"weights (outside vae/): {first['weight_bytes'] / 1e9:.2f} GB\n")
    titles = [*COLUMNS, "load", *FIRST_CALL, "total", "GB/s"]
    print("run " + " ".join(f"{t:>9}" for t in titles))
    for index, row in enumerate([*rows, min_row(rows)]):
        cells = {**row, "config": row["config"] + row["config_load"]}
        rate = row["weight_bytes"] / 1e9 / row["weights"] if row["weights"] > 0 else 0.0
        values = [cells[c] for c in [*COLUMNS, "load", *FIRST_CALL, "total"]] + [rate]
        label = "min" if index == len(rows) else str(index + 1)
        print(f"{label:<3} " + " ".join(f"{v:9.2f}" for v in values))
    if args.profile_first_call:  # the last run's (the page cache and the on-disk kernel caches warm)
        print(f"\nthe first call under cProfile (run {len(rows)}), by own time: own s, cumulative s")
        for where, own, cumulative in rows[-1]["first_call_top"]:
            print(f"  {own:8.3f} {cumulative:8.3f}  {where}")
    walls = {}
    if not args.no_cli:
        counts = [int(n) for n in args.gpus.split(",") if n] or [None]
        print("\n`mmgen generate` wall seconds (fresh process, page cache warm)")
        print(f"{'gpus':<6} {'min':>8} {'median':>8}  runs")
        # One untimed run per count first (the host's first job on several GPUs pays a first-use cost,
        # RESULTS.md 23b), then the counts alternate run by run, so a drift of the host hits each alike.
        for gpus in counts:
            cli_wall(args, gpus)
        by_count: dict[int | None, list] = {gpus: [] for gpus in counts}
        for _ in range(args.runs):
            for gpus in counts:
                by_count[gpus].append(cli_wall(args, gpus))
        splits, shas = {}, {}
        for gpus, measured in by_count.items():
            times = [wall for wall, _, _ in measured]
            walls[str(gpus or 1)] = times
            splits[str(gpus or 1)] = [split for _, split, _ in measured]
            shas[str(gpus or 1)] = sorted({sha for _, _, sha in measured})
            print(
                f"{gpus or '-':<6} {min(times):8.2f} {statistics.median(times):8.2f}  {', '.join(f'{t:.2f}' for t in times)}"
            )
        # where each run's wall went: the command's own seconds line, and what is left (its exit)
        names = ["start", "load", "text_encode", "denoise", "decode", "export"]
        shown = names[:2] + ["world_wait"] + names[2:]  # world_wait: the part of load spent waiting (ranks)
        # exit etc.: the rest before the command's lines came out (its interpreter's start before main, the
        # hand-over between stages, the ranks' end); ended: after them (the process's teardown)
        print(
            f"\n{'gpus':<6} {'wall':>7} "
            + " ".join(f"{n:>11}" for n in shown)
            + f" {'exit etc.':>10} {'ended':>6}"
        )
        for gpus, split_runs in splits.items():
            for wall, split in zip(walls[gpus], split_runs, strict=True):
                rest = wall - sum(split.get(n, 0.0) for n in names) - split["ended"]
                cells = " ".join(f"{split.get(n, 0.0):11.2f}" for n in shown)
                print(f"{gpus:<6} {wall:7.2f} {cells} {rest:10.2f} {split['ended']:6.2f}")
        same = len({sha for found in shas.values() for sha in found}) == 1
        print(f"\nframes sha256: {'one over every run and GPU count' if same else 'DIFFER'}: {shas}")
        walls = {"wall": walls, "seconds": splits, "frames_sha256": shas}
    if args.json:
        args.json.write_text(json.dumps({"runs": rows, "cli_wall": walls}, indent=2) + "\n")


def min_row(rows: list[dict]) -> dict:
    """Each column's minimum over the runs (the 'min' line; its columns need not add up)."""
    numeric = [k for k, v in rows[0].items() if isinstance(v, float | int)]
    return {**rows[0], **{k: min(r[k] for r in rows) for k in numeric}}


def _is_image_model(directory: Path) -> bool:
    index = Path(directory) / "model_index.json"
    return index.exists() and str(json.loads(index.read_text()).get("_class_name", "")).startswith(
        "QwenImage"
    )


def _env(root: Path = ROOT) -> dict[str, str]:
    """The environment of a child running the checkout at `root` (this one by default)."""
    return {**os.environ, "PYTHONPATH": checkout_pythonpath(root)}


# ----------------------------------------------------------------------------------------------
# random-weight directories


def write_model(kind: str, directory: Path, device: str) -> None:
    """Write a random-weight directory of `kind` into `directory` unless it already holds a model."""
    if (directory / "model_index.json").exists():
        print(f"{directory}: already holds a model directory (kept)")
        return
    sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
    tick = time.perf_counter()
    if kind.startswith("wan-"):
        from wan_models import write_random_wan_dir

        info = write_random_wan_dir(directory, dit_size=kind.removeprefix("wan-"), device=device)
    else:
        info = write_random_qwen_image_dir(directory, device=device)
    print(f"wrote {directory} ({kind}) in {time.perf_counter() - tick:.0f} s: {info}")
    # The weights were built on the device; give their memory back before the measured processes run
    # (a 20B Qwen-Image left 59 GiB in this process's cache: the measured load ran out of memory).
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def write_random_qwen_image_dir(directory: Path, *, device: str) -> dict:
    """Qwen-Image at its real sizes with random bf16 weights (20B transformer, Qwen2.5-VL-7B, the VAE in
    fp32), saved by diffusers' QwenImagePipeline.save_pretrained; the tests' tiny byte-level tokenizer
    (token ids differ from Qwen's, the work per token does not)."""
    import diffusers
    import torch
    from qwen_image_cases import SCHEDULER, hf_tokenizer, write_tokenizer
    from qwen_image_e2e import text_encoder_7b

    work = Path(tempfile.mkdtemp(prefix="mmgen-qwen-tok-"))
    write_tokenizer(work)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the device: never an fp32 copy
    try:
        with torch.device(device):
            transformer = diffusers.QwenImageTransformer2DModel().eval()  # its defaults: the 20B model
    finally:
        torch.set_default_dtype(previous)
    pipe = diffusers.QwenImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=diffusers.AutoencoderKLQwenImage().eval(),
        text_encoder=text_encoder_7b(torch.device(device), torch.bfloat16),
        tokenizer=hf_tokenizer(work),
        transformer=transformer,
    )
    pipe.save_pretrained(str(directory), max_shard_size="5GB")
    for name in ("tokenizer.json",):  # Qwen's layout: vocab.json + merges.txt
        (directory / "tokenizer" / name).unlink(missing_ok=True)
    write_tokenizer(directory / "tokenizer")
    return {"directory": str(directory), "model": "Qwen-Image (random bf16 weights)"}


if __name__ == "__main__":
    main()
