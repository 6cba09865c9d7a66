"""A model family mmgen does not ship: a tiny DiT, its directory, its loader and its pipeline, declared
as `FAMILY` for the entry-point group `mmgen.families` (tests/test_family_registry.py installs it by
writing a *.dist-info with an entry_points.txt onto PYTHONPATH; no face is touched).

The directory: model_index.json (_class_name ToyImagePipeline) and transformer/ (config.json +
model.safetensors). The model: 2x2 patches of a 3-channel latent at 1/4 of the image size, one
self-attention block conditioned on the timestep and on the prompt's bytes; Euler steps from noise;
decoded by nearest upsampling. An image family with one task (t2i) and no optional feature, so every
request field that needs one is refused by what the registry derives from its capabilities.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from mmgen.errors import ValidationError
from mmgen.families import Capabilities, Family
from mmgen.fingerprint import environment_fingerprint
from mmgen.outputs.writers import frames_sha256, tensor_sha256
from mmgen.parallel.layout import ParallelLayout
from mmgen.placement.policy import MemoryPlan
from mmgen.progress import as_reporter
from pipelines.common import GenerationResult
from pipelines.request import GenerationRequest

PIPELINE_CLASS = "ToyImagePipeline"
CONFIG = {"channels": 3, "patch": 2, "dim": 16, "heads": 2, "scale": 4}
SIZE_MULTIPLE = CONFIG["scale"] * CONFIG["patch"]
CAPABILITIES = Capabilities("image", ("t2i",))


class ToyDefaults:
    height = 32
    width = 32
    num_frames = 1
    num_inference_steps = 4
    fps = 1


class ToyDiT(nn.Module):
    """tokens [B, N, patch * patch * channels], t [B] in [0, 1], prompt bytes [B, L] int64 -> velocity like tokens."""

    def __init__(self, channels: int, patch: int, dim: int, heads: int, scale: int) -> None:
        super().__init__()
        width = patch * patch * channels
        self.heads = heads
        self.embed = nn.Linear(width, dim)
        self.time = nn.Linear(1, dim)
        self.text = nn.Embedding(256, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, width)

    def forward(self, tokens: torch.Tensor, t: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
        batch, count, _ = tokens.shape
        h = self.embed(tokens) + self.time(t[:, None, None]) + self.text(prompt).mean(1, keepdim=True)
        q, k, v = self.qkv(h).view(batch, count, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, count, -1)
        return self.out(h + self.proj(attended))


def write_toy_dir(directory: Path, seed: int = 0) -> Path:
    """A toy model directory with seeded random weights."""
    torch.manual_seed(seed)
    (directory / "transformer").mkdir(parents=True)
    (directory / "model_index.json").write_text(json.dumps({"_class_name": PIPELINE_CLASS}))
    (directory / "transformer" / "config.json").write_text(json.dumps(CONFIG))
    save_file(ToyDiT(**CONFIG).state_dict(), str(directory / "transformer" / "model.safetensors"))
    return directory


class ToyPipeline:
    defaults = ToyDefaults()
    capabilities = CAPABILITIES
    layout = ParallelLayout.single()

    def __init__(self, dit: ToyDiT) -> None:
        self.dit = dit.eval()

    def check_request(self, request: GenerationRequest) -> GenerationRequest:
        refused = self.capabilities.refusals(request, "Toy")
        for name in ("preset", "lora"):
            if getattr(request, name):
                refused.append(f"{name}: the Toy family has none")
        if request.num_frames not in (None, 1):
            refused.append(f"num_frames = {request.num_frames}: the Toy model makes one image")
        for name in ("height", "width"):
            value = getattr(request, name)
            if value is not None and value % SIZE_MULTIPLE:
                refused.append(f"{name} = {value}: must be a multiple of {SIZE_MULTIPLE}")
        if refused:
            raise ValidationError("; ".join(refused))
        d = self.defaults
        given = {
            "height": d.height,
            "width": d.width,
            "num_frames": 1,
            "num_inference_steps": d.num_inference_steps,
        }
        filled = {name: value for name, value in given.items() if getattr(request, name) is None}
        return request.with_values(**filled) if filled else request

    @torch.no_grad()
    def generate(self, request: GenerationRequest, *, progress: Any = False) -> GenerationResult:
        tick = time.perf_counter()
        request = self.check_request(request)
        if request.seed is None:
            request = request.with_values(seed=secrets.randbits(63))
        reporter, owned = as_reporter(progress)
        patch, channels, scale = CONFIG["patch"], CONFIG["channels"], CONFIG["scale"]
        rows, cols = request.height // scale // patch, request.width // scale // patch
        generator = torch.Generator().manual_seed(request.seed)
        x = torch.randn((1, rows * cols, patch * patch * channels), generator=generator)
        prompt = torch.tensor([list(request.prompt.encode()[:64])], dtype=torch.int64)
        sigmas = torch.linspace(1.0, 0.0, request.num_inference_steps + 1)
        reporter.stage("denoise", request.num_inference_steps)
        for sigma, following in zip(sigmas[:-1], sigmas[1:], strict=True):
            x = x + (following - sigma) * self.dit(x, sigma.view(1), prompt)
            reporter.advance()
        reporter.stage("decode", 1)
        grid = x.view(1, rows, cols, patch, patch, channels).permute(0, 5, 1, 3, 2, 4)
        latents = grid.reshape(1, channels, rows * patch, cols * patch)
        pixels = F.interpolate(latents, scale_factor=scale, mode="nearest").tanh()
        frames = ((pixels[0].permute(1, 2, 0) + 1) * 127.5).round().to(torch.uint8).numpy()[None]
        reporter.advance()
        if owned:
            reporter.close()
        providers = {"toy.attn": "sdpa"}
        return GenerationResult(
            frames=frames,
            frames_sha256=frames_sha256(frames),
            latents=latents,
            latents_sha256=tensor_sha256(latents),
            timings={"total": time.perf_counter() - tick},
            fingerprint=environment_fingerprint(
                device="cpu", dtype=torch.float32, attention_providers=providers
            ),
            attention_providers=providers,
            # what every result records: the request, its fps, the memory plan (all resident here)
            args={**request.record(), "fps": self.defaults.fps, "memory_plan": MemoryPlan().record()},
        )


def load_toy(
    directory: Path,
    *,
    task: str,
    device: str,
    dtype: str,
    offload: str | None,
    gpu_memory_gb: float | None,
    load_on_host: bool | None,
    parallel: Any,
) -> ToyPipeline:
    if task != "t2i" or device != "cpu" or offload not in (None, "none") or gpu_memory_gb is not None:
        raise ValidationError(
            f"the Toy family loads for t2i on the CPU only (task {task!r}, device {device!r})"
        )
    if parallel is not None and parallel.world_size > 1:
        raise ValidationError("parallel: the Toy family runs in one process")
    dit = ToyDiT(**json.loads((directory / "transformer" / "config.json").read_text()))
    dit.load_state_dict(load_file(str(directory / "transformer" / "model.safetensors")))
    return ToyPipeline(dit)


FAMILY = Family(
    name="toy",
    title="Toy",
    capabilities=CAPABILITIES,
    pipeline_classes=(PIPELINE_CLASS,),
    load=load_toy,
)
