"""Where weights live while a pipeline runs: the offload policy, its budget planner and the movers.

- `policy`: the frozen `MemoryPlan` (offload none | model | layer, CFG batch | sequential, FFN token
  chunk, block chunk, decode full | frames | bandsN | tiled | split) and `plan_memory`, which picks the
  least offloading that fits a GPU budget from shape-based estimates;
- `tensors`: `TensorGroup`, a module's parameters and buffers kept once in host memory and bound to
  host or device storage without copying views apart (fused projections stay fused);
- `stream`: `BlockStream`, a model's blocks run with their weights streamed one group ahead;
- `offload`: `OffloadPlacement`, the denoise loop's Placement for a plan: experts, text encoder, VAE;
- `peaks`: peak GPU memory per stage.
"""
