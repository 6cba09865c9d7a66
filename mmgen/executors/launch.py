"""The one launch helper of the faces that run one job (or one server) over several GPUs.

`mmgen generate --gpus N` and `mmgen serve --gpus N` take the same flags (mmgen.cli_args
.add_parallel_flags) and take the same steps before anything loads: the ParallelConfig of the flags
(or of torchrun's WORLD_SIZE), the visible devices and the model's head count (as its family reads
it, mmgen.families) checked, then one of:
this process is a rank torchrun started, it is the only process, or it spawns the ranks
(mmgen.parallel.launch.run_parallel). `launch` is those steps, once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mmgen.errors import ValidationError
from mmgen.families import family_of
from mmgen.parallel.launch import check_model_heads
from mmgen.parallel.layout import ParallelConfig
from pipelines.capabilities import FEATURES
from pipelines.loader import model_directory


def flags_config(gpus: int | None, sp: int | None, cfg: bool, ring: int) -> ParallelConfig:
    """The ParallelConfig of --gpus/--sp/--ring/--cfg-parallel (torchrun's WORLD_SIZE when --gpus is
    not given; one process when neither is)."""
    count = gpus if gpus is not None else int(os.environ.get("WORLD_SIZE", 1))
    return ParallelConfig.for_gpus(count, sp=sp, cfg=cfg, ring=ring)


def launch(
    fn: Callable[..., Any],
    config: ParallelConfig,
    device_type: str,
    model: Path | str | None,
    *args: Any,
    started: Any = None,
    settles: bool = False,
) -> Any:
    """fn(layout, *args) on every rank of `config`; rank 0's value. layout is None in a single
    process. Checked first, before any rank runs or any weight loads: the GPUs this machine
    shows and what the model's family runs on (check_parallel_model: its heads, read from its
    config, against the Ulysses degree).
    started: rank processes spawned before this process parsed (mmgen.parallel.standby), used
    when they fit the run (a leading one's rank 0 this process: mmgen.parallel.lead); their owner
    stops them when it is done. settles: fn may get a
    mmgen.parallel.launch.PendingLayout from them (their world still joining) and settles it itself
    (its loader does, after reading the weights)."""
    # Looked up when called (torch is not imported at `mmgen --help`; tests replace run_parallel).
    from mmgen.parallel import launch as spawn

    check_launch(config, device_type, model)
    if spawn.torchrun_environment():
        return fn(spawn.layout_from_environment(config, device_type), *args)
    if config.world_size == 1:
        return fn(None, *args)
    if started is not None and started.leads and started.fits(config, 1, spawn.DEFAULT_TIMEOUT_S):
        from mmgen.parallel.lead import run_led  # (launch is looked up when called: see above)

        return run_led(fn, config, args, started=started, device_type=device_type, settles=settles)
    return spawn.run_parallel(fn, config, *args, device_type=device_type, started=started, settles=settles)


def check_launch(config: ParallelConfig, device_type: str, model: Path | str | None) -> None:
    """What `launch` checks before any rank starts: the GPUs this machine shows and what the model's
    family runs on (check_parallel_model: several processes at all, a ring, its heads against the
    Ulysses degree); a caller that prepares more before launching checks first."""
    from mmgen.parallel.launch import check_devices

    check_devices(config, device_type)
    check_parallel_model(config, model)


def check_parallel_model(config: ParallelConfig, model: Path | str | None) -> None:
    """Before any rank starts or any weight loads, as the model's family declares it (mmgen.families):
    a family runs over several processes only with the capability "parallel", its attention a ring
    only where it has one (Family.ring), and its heads (Family.heads, read from the config) must
    split over the Ulysses degree. model: a directory, None = the embedded default."""
    if config.world_size == 1:
        return
    directory = model_directory(model)
    family = family_of(directory)
    if not family.capabilities.has("parallel"):
        raise ValidationError(
            f"--gpus {config.world_size}: not supported by the {family.title} pipeline "
            f"({FEATURES['parallel']}); use --gpus 1"
        )
    heads = None if family.heads is None else family.heads(directory)
    check_model_heads(config, heads, ring=family.ring, title=family.title)
