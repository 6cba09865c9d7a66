"""`mmgen render FILE --gpus N [--sp S] [--ring R] [--cfg-parallel]`: groups of ranks pulling jobs from one queue.

N GPUs (CPU: gloo processes) form N / G groups of G = S x (2 with --cfg-parallel) ranks; each group
is its own torch.distributed world running one job at a time over its ranks (mmgen.executors.groups,
the local-groups executor). This process, the render's driver holding the output directory's lock,
writes every output and manifest record exactly as a one-process render does (runner.write_job); a
rerun, with any group count, resumes from the manifest like a one-process render.
"""

from __future__ import annotations

from mmgen.errors import ValidationError
from mmgen.executors.groups import LocalGroupsExecutor
from mmgen.executors.launch import check_parallel_model
from mmgen.parallel.layout import ParallelConfig
from mmgen.render.runner import RenderSummary, run_render
from mmgen.render.schema import RenderPlan


def render_groups(gpus: int, sp: int | None, ring: int, cfg: bool) -> tuple[ParallelConfig, int]:
    """(each group's ParallelConfig, number of groups) for --gpus/--sp/--ring/--cfg-parallel; sp defaults to 1."""
    config = ParallelConfig(sp=1 if sp is None else sp, ring=ring, cfg=cfg)
    if not isinstance(gpus, int) or gpus < 1 or gpus % config.world_size:
        raise ValidationError(
            f"--gpus {gpus} does not split into groups of {config.world_size} "
            f"(--sp {config.sp}{' x 2 for --cfg-parallel' if cfg else ''}); use a multiple of {config.world_size}"
        )
    return config, gpus // config.world_size


def run_render_groups(
    plan: RenderPlan,
    config: ParallelConfig,
    groups: int,
    *,
    resume: bool = True,
    save_frames: bool = False,
    replace_others: bool = False,
) -> RenderSummary:
    """Render the plan's pending jobs on `groups` worlds of config.world_size ranks (see the module
    docstring). The model's family is asked first whether it runs on such a world (its heads against
    the Ulysses degree), before any group spawns."""
    check_parallel_model(config, plan.model)
    return run_render(
        plan,
        resume=resume,
        save_frames=save_frames,
        show_progress=False,
        replace_others=replace_others,
        executor=lambda p: LocalGroupsExecutor(p.model_spec(), config, groups),
    )
