"""`mmgen serve`: the OpenAI-shaped video / image server. `register(subparsers)` adds the subcommand.

Binds 127.0.0.1 by default. Once the socket is bound it prints one line to stdout,
"mmgen serve: listening on http://HOST:PORT" (with --port 0 the port the system chose), then serves
until SIGINT / SIGTERM. The model loads in the worker thread; /health answers 200 once it has.

With --gpus N (--sp, --ring, --cfg-parallel as `mmgen generate` takes them; on the CPU N gloo
processes) this process binds the socket and launches N ranks (mmgen.parallel.launch.run_parallel):
rank 0 serves HTTP on that socket, owns the queue and writes every output; the others run each job
with it (mmgen.executors.group_link). A SIGTERM stops every rank; a kill -9 of this process takes the
ranks with it (they die with their parent), and a restart re-queues what was running.

A rank killed or hung (no heartbeat for mmgen.parallel.rank_watch.LIVENESS_S) mid-job: the launcher
stops the whole group at once (SIGKILL: a member of a broken NCCL communicator is not safely
reused, so no rank is kept), ends the job that was running `failed` (server_error, the launcher's
line naming the rank) and launches the group again on the same socket: connections wait in its
backlog meanwhile, /health says "restarting" (and why) while the new group loads, and queued jobs
stay queued and run on it. A group that fails again and again with no job running (a rank that
cannot load) is not restarted past MAX_IDLE_RESTARTS: the command then ends with the error.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from mmgen.cli_args import add_parallel_flags
from mmgen.errors import ValidationError, one_line
from pipelines.checks import MAX_PIXELS

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
API_KEY_ENV = "MMGEN_API_KEY"
MAX_IDLE_RESTARTS = 3  # group failures in a row with no job running before the server gives up
FAULT_WINDOW_S = 5.0  # a job failed this long before the launcher saw the fault failed of it


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `serve` to an argparse subparsers object."""
    serve = subparsers.add_parser(
        "serve",
        help="serve the OpenAI Videos / Images API (a durable queue, progress, cancel, a web page)",
        description="Load the model once and serve POST /v1/videos, /v1/images/generations and the rest "
        "of the OpenAI Videos / Images shape. Jobs live in SQLite under --state and survive a restart.",
    )
    serve.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a local model directory of a registered family (diffusers format or the family's original "
        "layout; default: the embedded model); a video model serves /v1/videos, an image model "
        "/v1/images/generations (and /v1/images/edits where it edits)",
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    serve.add_argument("--port", type=int, default=8000, help="port (0: any free port, printed at start)")
    serve.add_argument(
        "--state", type=Path, default=Path("mmgen-serve"), help="job database, outputs, uploads"
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every route but /health (or env {API_KEY_ENV})",
    )
    serve.add_argument(
        "--max-queue", type=int, default=256, help="queued + running jobs before 429 (default 256)"
    )
    serve.add_argument(
        "--max-pixels",
        type=int,
        default=MAX_PIXELS,
        help=f"frames x height x width one job may ask for, at most {MAX_PIXELS} (the default: 129 "
        "frames of 1280x720, the bound of every request)",
    )
    serve.add_argument("--lora-dir", type=Path, default=None, help="directory request LoRA paths must lie in")
    serve.add_argument(
        "--input-dir", type=Path, default=None, help="directory request image paths must lie in"
    )
    serve.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda if available"
    )
    serve.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="fp32 on CPU, bf16 on CUDA by default"
    )
    serve.add_argument(
        "--offload", choices=("none", "model", "layer"), default=None, help="the pipeline's default placement"
    )
    serve.add_argument(
        "--gpu-memory-gb", type=float, default=None, help="the pipeline's default GPU memory budget"
    )
    add_parallel_flags(serve, sp_default="all of --gpus (half with --cfg-parallel)")
    ray = serve.add_argument_group("Ray cluster (pip install mmgen[ray])")
    ray.add_argument(
        "--ray",
        default=None,
        metavar="auto|ADDRESS",
        help="run the jobs on Ray replicas: 'auto' (a running cluster) or its address; this process "
        "keeps the queue and writes every output",
    )
    ray.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="Ray replicas, each one process with its own pipeline draining the one queue (default 1)",
    )
    serve.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Check the settings, then serve in this process, or launch the ranks of --gpus N (rank 0 serves)."""
    try:  # missing server packages fail here, before anything starts
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise ValidationError(f"mmgen serve needs {err.name}: pip install 'mmgen[serve]'") from None
    from mmgen.executors.launch import flags_config, launch
    from mmgen.parallel.launch import torchrun_environment
    from pipelines.loader import resolve_device

    check_settings(args)
    if args.ray is not None:
        from mmgen.executors.ray_cluster import cluster_address, probe

        probe(*cluster_address(args.ray))  # one line now, not a server whose replicas never start
        return serve_on_rank(None, args)
    config = flags_config(args.gpus, args.sp, args.cfg_parallel, args.ring)
    device_type = resolve_device(args.device).partition(":")[0]
    if config.world_size > 1 and not torchrun_environment():
        return serve_group(config, device_type, args)
    # the devices and the model's head count are checked before any rank starts or loads
    return launch(serve_on_rank, config, device_type, args.model, args)


def serve_group(config: Any, device_type: str, args: argparse.Namespace) -> int:
    """Launch the ranks of --gpus N on a socket bound here, and launch them again after a rank is
    killed or hangs (module docstring): the running job ends failed, the server goes on."""
    from mmgen.executors.launch import check_launch, launch
    from mmgen.parallel.launch import RankFailed
    from mmgen.serve.queue import JobStore

    check_launch(config, device_type, args.model)  # before anything binds or spawns
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    print(f"mmgen serve: listening on http://{host}:{port}", flush=True)
    cause: str | None = None
    idle_failures = 0
    while True:
        try:
            return launch(serve_on_rank, config, device_type, args.model, args, sock, cause)
        except RankFailed as err:
            cause = one_line(err)
            args.state.mkdir(parents=True, exist_ok=True)
            store = JobStore(args.state / "jobs.sqlite3")
            try:
                ended = store.fail_interrupted(cause, time.time() - FAULT_WINDOW_S)
            finally:
                store.close()
            idle_failures = 0 if ended else idle_failures + 1
            if idle_failures > MAX_IDLE_RESTARTS:
                raise
            jobs = f" (job {', '.join(ended)} failed)" if ended else ""
            print(f"mmgen serve: {cause}{jobs}; restarting the group", file=sys.stderr, flush=True)


def serve_on_rank(
    layout: Any, args: argparse.Namespace, sock: socket.socket | None = None, restarting: str | None = None
) -> int:
    """One rank of `mmgen serve` (layout None: the only process). Rank 0 serves (on `sock` when the
    launcher bound it, else binds) and runs the queue's jobs with the group; every other rank loads
    the same pipeline and follows rank 0's jobs. `restarting`: why the launcher restarted the group."""
    if layout is not None and not layout.owns_outputs:
        from mmgen.executors.group_link import follow

        # A following rank ends when rank 0 says stop: SIGTERM / SIGINT go to rank 0, which finishes
        # its shutdown and stops the group (the launcher SIGKILLs a rank still there after its grace).
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        follow(pipeline_loader(args, layout)(), layout)
        return 0
    import uvicorn

    from mmgen.serve.app import create_app

    service = build_service(args, layout, restarting)
    if sock is None:
        sock = _bind(args.host, args.port)
        host, port = sock.getsockname()[:2]
        print(f"mmgen serve: listening on http://{host}:{port}", flush=True)
    config = uvicorn.Config(create_app(service), log_level="warning", access_log=False, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def check_settings(args: argparse.Namespace) -> None:
    """The server-wide settings' errors, before anything binds, spawns or loads."""
    if args.max_queue < 1:
        raise ValidationError(f"--max-queue = {args.max_queue}: must be >= 1")
    if not 1 <= args.max_pixels <= MAX_PIXELS:
        raise ValidationError(
            f"--max-pixels = {args.max_pixels}: must be in [1, {MAX_PIXELS}] (no request may ask for more)"
        )
    for flag, directory in (("--lora-dir", args.lora_dir), ("--input-dir", args.input_dir)):
        if directory is not None and not directory.is_dir():
            raise ValidationError(f"{flag} {str(directory)!r}: directory not found")
    if args.model is not None and not args.model.is_dir():
        raise ValidationError(f"--model {str(args.model)!r}: directory not found")
    replicas, ray = getattr(args, "replicas", None), getattr(args, "ray", None)
    if replicas is not None and ray is None:
        raise ValidationError("--replicas needs --ray auto|ADDRESS")
    if replicas is not None and replicas < 1:
        raise ValidationError(f"--replicas = {replicas}: must be >= 1")
    if ray is not None and (args.gpus is not None or args.sp is not None or args.cfg_parallel):
        raise ValidationError(
            "--ray: use --replicas N (each replica one process); --gpus/--sp/--cfg-parallel "
            "replicas are not served on Ray yet"
        )


def build_service(args: argparse.Namespace, layout: Any = None, restarting: str | None = None) -> Any:
    """The Service of parsed `serve` arguments (nothing loaded yet: the worker loads the model);
    `layout`: rank 0's ParallelLayout under --gpus N (its worker hands every job to the group);
    `restarting`: why the group was launched again (/health says so while it loads)."""
    from mmgen.executors.group_link import GroupLink
    from mmgen.serve.service import ServeSettings, Service

    check_settings(args)
    settings = ServeSettings(
        state=args.state,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_queue=args.max_queue,
        max_pixels=args.max_pixels,
    )
    group = GroupLink(layout) if layout is not None and not layout.is_single else None
    return Service(
        settings,
        Path(model_directory(args)).resolve().name,
        pipeline_loader(args, layout),
        lora_dir=args.lora_dir,
        input_dir=args.input_dir,
        group=group,
        executor=None if getattr(args, "ray", None) is None else ray_executor(args),
        spec=model_spec(args),
        restarting=restarting,
    )


def model_spec(args: argparse.Namespace) -> Any:
    """The ModelSpec of the served model (what the worker or each Ray replica loads)."""
    from mmgen.executors.jobs import ModelSpec

    return ModelSpec(
        model="default" if args.model is None else str(args.model.resolve()),
        task=served_task(args),
        dtype=DTYPES[args.dtype] if args.dtype else "auto",
        device=args.device,
        offload=args.offload,
        gpu_memory_gb=args.gpu_memory_gb,
    )


def ray_executor(args: argparse.Namespace) -> Any:
    """A function building the Ray replicas of `--ray ADDRESS --replicas N` (called in the worker
    thread). Each replica loads the model on its own node: --model at the same path there, or the
    embedded default built there."""
    from mmgen.executors.ray_executor import RayExecutor  # optional: ray, imported when it starts

    spec = model_spec(args)

    def start() -> Any:
        return RayExecutor(
            spec,
            address=args.ray,
            replicas=args.replicas or 1,
            log=lambda line: print(f"mmgen serve: {line}", file=sys.stderr, flush=True),
        )

    return start


def served_task(args: argparse.Namespace) -> str:
    """'t2i' for a model of an image family (the family registry says which), else 't2v' (the
    embedded default too)."""
    from mmgen.families import makes_images

    return "t2i" if makes_images(args.model) else "t2v"


def model_directory(args: argparse.Namespace) -> Path:
    from mmgen.default_model import ensure_default_model

    return ensure_default_model() if args.model is None else args.model


def pipeline_loader(args: argparse.Namespace, layout: Any = None) -> Any:
    """A function loading the served pipeline (on `layout`'s rank when given); called in the worker."""
    from mmgen.families import load_pipeline
    from pipelines.loader import resolve_device, resolve_dtype

    directory = model_directory(args)
    device = resolve_device(args.device)
    dtype = resolve_dtype(DTYPES[args.dtype] if args.dtype else "auto", device)
    task = served_task(args)  # an image-only model loads as one

    def load() -> Any:
        return load_pipeline(
            directory,
            task=task,
            device=device,
            dtype=dtype,
            offload=args.offload,
            gpu_memory_gb=args.gpu_memory_gb,
            parallel=layout,
        )

    return load


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValidationError(f"--host {host} --port {port}: cannot bind ({err.strerror})") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    """`python -m mmgen.serve.cli ...` (the same as `mmgen serve ...`)."""
    from mmgen.cli_args import run_command

    parser = argparse.ArgumentParser(prog="mmgen")
    register(parser.add_subparsers())
    return run_command(parser.parse_args(["serve", *(argv if argv is not None else sys.argv[1:])]))


if __name__ == "__main__":
    sys.exit(main())
