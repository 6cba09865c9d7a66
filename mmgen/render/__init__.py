"""Batch renders from YAML, manifests and A/B comparison.

schema    the render YAML: pydantic models, every mistake in one report, a frozen RenderPlan
manifest  manifest.jsonl: append-only job records, repair after a kill
runner    run_render: the driver; hands jobs to an executor (mmgen.executors), writes and records what comes back
groups    --gpus/--sp: the render's groups of ranks (mmgen.executors.groups.LocalGroupsExecutor)
metrics   max/mean absolute difference and PSNR of uint8 frames
contact   contact sheets: baseline | candidate | difference heatmap
ab        run_ab: baseline vs candidate on the same jobs, fingerprint refusal, --expect
cli       register(subparsers): the `render` and `ab` subcommands
"""
