"""Several GPUs: the ParallelLayout value, sequence/CFG parallelism around attention, worker launch.

The layout is built once at start-up and passed down (pipeline -> model call -> attention site);
nothing here is a module-level process group.
"""

from mmgen.parallel.layout import ParallelConfig, ParallelLayout, init_layout

__all__ = ("ParallelConfig", "ParallelLayout", "init_layout")
