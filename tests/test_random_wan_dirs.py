"""The random-weight Wan directories the GPU benchmarks write (benchmarks/wan_models.py): the shards
read back through safetensors' own reader, and a tiny Wan2.2-A14B-shaped directory loads through
mmgen's loader as two experts and runs a job whose steps go to each expert by the boundary."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def wan_models():
    """benchmarks/wan_models.py as a module (benchmarks/ is not a package); registered while it runs,
    as its dataclasses need, and taken out after."""
    name = "benchmarks_wan_models"
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / "wan_models.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]


def test_shards_read_back_through_safetensors(wan_models, tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(64, 32, generator=gen).to(torch.bfloat16),
        "b.bias": torch.randn(7, generator=gen),  # fp32, odd byte count: the next offset unaligned
        "c.table": torch.randn(1, 3, 5, generator=gen).to(torch.bfloat16),
        "d.scalar": torch.tensor(2.5),
    }
    total = wan_models._save_shards(tensors, tmp_path, "model", shard_bytes=4096)
    files = sorted(tmp_path.glob("model-*.safetensors"))
    assert total == sum(t.numel() * t.element_size() for t in tensors.values())
    assert len(files) == 2  # a.weight fills the first 4 KiB shard
    read = {}
    for file in files:
        read |= load_file(str(file))
    assert read.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name


def test_tiny_a14b_dir_loads_two_experts_and_switches_at_the_boundary(wan_models, tmp_path: Path) -> None:
    from mmgen.executors.in_process import load_pipeline
    from mmgen.executors.jobs import ModelSpec
    from pipelines.request import GenerationRequest

    info = wan_models.write_random_wan_dir(
        tmp_path, tiny=True, text_encoder="reduced", device="cpu", two_experts=True
    )
    assert info["dit"] == wan_models.dit_label("14b", two_experts=True, tiny=True)
    pipe = load_pipeline(ModelSpec(model=str(tmp_path), device="cpu", dtype="float32"))
    high, low = pipe.experts
    assert pipe.components.boundary_ratio == 0.875
    different = [n for n, p in high.named_parameters() if not torch.equal(p, low.get_parameter(n))]
    assert len(different) > len(list(high.parameters())) // 2  # every matrix; norms (1) and biases (0) agree

    timesteps: dict[int, list[float]] = {0: [], 1: []}
    for index, expert in enumerate((high, low)):
        expert.register_forward_pre_hook(
            lambda module, args, kwargs, index=index: timesteps[index].extend(args[1].flatten().tolist()),
            with_kwargs=True,
        )
    request = GenerationRequest(
        prompt="a fox", seed=0, height=64, width=96, num_frames=5, num_inference_steps=4, guidance_scale=5.0
    )
    result = pipe.generate(request)
    assert result.frames.shape == (5, 64, 96, 3)
    # Flow shift 12 over 4 steps: t = 1000, ~971, ~923 on the high-noise expert, ~800 on the low-noise one.
    assert timesteps[0] and timesteps[1]
    assert min(timesteps[0]) >= 875 > max(timesteps[1])
