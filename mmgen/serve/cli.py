"""`mmgen serve`: the OpenAI-shaped video / image server. `register(subparsers)` adds the subcommand.

Binds 127.0.0.1 by default. Once the socket is bound it prints one line to stdout,
"mmgen serve: listening on http://HOST:PORT" (with --port 0 the port the system chose), then serves
until SIGINT / SIGTERM. The model loads in the worker thread; /health answers 200 once it has.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Any

from mmgen.errors import ValidationError

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
API_KEY_ENV = "MMGEN_API_KEY"


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
        help="diffusers-format Wan directory (default: the embedded model)",
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
        default=1280 * 720 * 129,
        help="frames x height x width one job may ask for (default 1280x720 at 129 frames)",
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
    serve.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Check the settings, bind, start the worker (which loads the model) and serve until stopped."""
    try:
        import uvicorn

        from mmgen.serve.app import create_app
    except ImportError as err:
        raise ValidationError(f"mmgen serve needs {err.name}: pip install 'mmgen[serve]'") from None

    service = build_service(args)
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    print(f"mmgen serve: listening on http://{host}:{port}", flush=True)
    config = uvicorn.Config(create_app(service), log_level="warning", access_log=False, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def build_service(args: argparse.Namespace) -> Any:
    """The Service of parsed `serve` arguments (nothing loaded yet: the worker loads the model)."""
    from mmgen.default_model import ensure_default_model
    from mmgen.serve.service import ServeSettings, Service
    from pipelines.loader import load_pipeline, resolve_device, resolve_dtype

    if args.max_queue < 1:
        raise ValidationError(f"--max-queue = {args.max_queue}: must be >= 1")
    if args.max_pixels < 1:
        raise ValidationError(f"--max-pixels = {args.max_pixels}: must be >= 1")
    for flag, directory in (("--lora-dir", args.lora_dir), ("--input-dir", args.input_dir)):
        if directory is not None and not directory.is_dir():
            raise ValidationError(f"{flag} {str(directory)!r}: directory not found")
    if args.model is not None and not args.model.is_dir():
        raise ValidationError(f"--model {str(args.model)!r}: directory not found")
    directory = ensure_default_model() if args.model is None else args.model
    device = resolve_device(args.device)
    dtype = resolve_dtype(DTYPES[args.dtype] if args.dtype else "auto", device)
    settings = ServeSettings(
        state=args.state,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_queue=args.max_queue,
        max_pixels=args.max_pixels,
    )

    def load() -> Any:
        return load_pipeline(
            directory,
            task="t2v",
            device=device,
            dtype=dtype,
            offload=args.offload,
            gpu_memory_gb=args.gpu_memory_gb,
        )

    model = Path(directory).resolve().name
    return Service(settings, model, load, lora_dir=args.lora_dir, input_dir=args.input_dir)


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
