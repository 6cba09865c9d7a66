"""Several GPUs: the ParallelLayout value, sequence/CFG parallelism around attention, worker launch.

The layout is built once at start-up and passed down (pipeline -> model call -> attention site);
nothing here is a module-level process group. The package itself imports nothing: a rank started
early (standby.py) sets itself up before it imports torch.
"""
