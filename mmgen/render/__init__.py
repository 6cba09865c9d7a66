"""Batch renders from YAML, manifests and A/B comparison.

schema    the render YAML: pydantic models, every mistake in one report, a frozen RenderPlan
manifest  manifest.jsonl: append-only job records, repair after a kill
executors where jobs run: RenderedJob, render_job, the Executor protocol, InProcessExecutor
runner    run_render: the driver; hands jobs to an executor, writes and records what comes back
groups    --gpus/--sp: local torch.distributed worlds as an executor (LocalGroupsExecutor)
ray_executor  --ray: Ray actor replicas as an executor (the optional `ray` extra)
metrics   max/mean absolute difference and PSNR of uint8 frames
contact   contact sheets: baseline | candidate | difference heatmap
ab        run_ab: baseline vs candidate on the same jobs, fingerprint refusal, --expect
cli       register(subparsers): the `render` and `ab` subcommands
"""
