"""T2V and T2I pipelines composed from mmgen parts."""
