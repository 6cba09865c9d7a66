"""Where jobs run, below every face (render, serve, `mmgen generate`): the executors and their values.

jobs          ModelSpec, JobSpec, RenderedJob, JobStopped (the one stop signal), ReplicaUnavailable
protocol      the Executor and Pipeline protocols
in_process    InProcessExecutor (alone, or leading a group as its rank 0); render_job (one job on a
              loaded pipeline); load_pipeline(ModelSpec)
group_link    how the ranks of one local group run each job together (rank 0 leads, the others follow)
groups        LocalGroupsExecutor: local torch.distributed worlds of spawned processes
launch        the one launch helper of `generate --gpus` and `serve --gpus` (checks, torchrun, spawn)
scheduling    which free replica takes which job (LoRA affinity)
ray_cluster   connecting to a Ray cluster (bounded), device auto, resources checked before placing
ray_executor  RayExecutor: Ray actor replicas (the optional `ray` extra); ray_replica: the actors' side

An executor never writes outputs: its client writes each RenderedJob through the atomic writers and
records it, so a job is recorded once wherever it ran.
"""
