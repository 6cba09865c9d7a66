"""What the Qwen-Image-2.1 parallel tests run on every forked rank (module-level, as parallel_workers).

Each rank builds the same seeded model and inputs, runs the single-process reference itself, then the
parallel path, and returns (rank 0) the max abs differences by case name. Every case runs with the
prefix KV cache on: the prefill that fills it and a cached step that reads it.
"""

from __future__ import annotations

import torch

from mmgen.attention import FlashAttentionImpl, SDPAImpl
from mmgen.models.qwen_image21 import PrefixCache, QwenImage21Config, QwenImage21Transformer
from mmgen.models.qwen_image21_layout import BlockCausalLayout
from mmgen.parallel.layout import ParallelConfig, ParallelLayout, init_layout
from pipelines.denoise import DenoiseModels, DenoiseOptions, ResidentPlacement, plan_steps, predict_noise
from pipelines.qwen_image21_family import Branch21, QwenImage21Conditioning, QwenImage21Hooks

# 8 heads: Ulysses 2 leaves 4 heads per rank, Ulysses 4 two, so a head-order slip inside a rank's
# group shows at both degrees. axes_dims_rope (2, 2, 4) sum to the head dim 8.
TINY = QwenImage21Config(
    in_channels=4,
    out_channels=4,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=8,
    context_in_dim=16,
    mlp_ratio=2,
    axes_dims_rope=(2, 2, 4),
)
TARGET = (1, 3, 4)  # 12 target tokens
CONDITION = (1, 2, 2)  # 4 condition tokens = one image slot
GUIDANCE = 4.0
TIMESTEPS = (800.0, 600.0)  # the prefill, then a cached step
IMPLS = (("sdpa", SDPAImpl), ("reference", lambda: FlashAttentionImpl("reference")))


def tiny_model() -> QwenImage21Transformer:
    """TINY with seeded normal weights (std 0.1; the zero-initialized text norm too), fp32, eval."""
    model = QwenImage21Transformer(TINY)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval()


def case_inputs(edit: bool, device: torch.device | str = "cpu") -> dict:
    """Two prompts of different lengths (7 and 5 tokens); an edit has one slot in each (another column).

    Packed rows: 35 (T2I) or 41 (edit) in the prefill, 24 in a cached step: none divides by 2 or 4,
    so the last ranks hold padding rows.
    """
    g = torch.Generator().manual_seed(3 + edit)
    lens, width = (7, 4) if not edit else (7, 5), 7
    grids = [CONDITION, TARGET] if edit else [TARGET]
    slots = None
    if edit:
        slots = torch.zeros(2, width, dtype=torch.bool)
        slots[0, 2] = slots[1, 1] = True
    tokens = sum(h * w for _, h, w in grids)
    return {
        "text": torch.randn(2, width, TINY.context_in_dim, generator=g).to(device),
        "lens": lens,
        "grids": grids,
        "slots": slots,
        "latents": [torch.randn(2, tokens, TINY.in_channels, generator=g).to(device) for _ in TIMESTEPS],
    }


def _model_steps(model, inputs, layout: BlockCausalLayout, impl, parallel) -> list[torch.Tensor]:
    """The prefill and one cached step of one packed call (both prompts), and an uncached call."""
    cache = PrefixCache()
    outputs = []
    for latents, t in zip(inputs["latents"], TIMESTEPS, strict=True):
        text = None if cache.filled else inputs["text"]
        timestep = torch.full((2,), t / 1000, device=latents.device)
        outputs.append(
            model(latents, timestep, text, attention=impl, metadata=layout, cache=cache, parallel=parallel)
        )
    timestep = torch.full((2,), TIMESTEPS[1] / 1000, device=latents.device)
    outputs.append(
        model(
            inputs["latents"][1], timestep, inputs["text"], attention=impl, metadata=layout, parallel=parallel
        )
    )
    return outputs


def model_layouts(layout: ParallelLayout, impls=IMPLS) -> dict[str, float]:
    """The transformer under Ulysses (the world's size) against parallel=None: T2I and edit, the row
    kernels (their torch references on the CPU) on and off, each impl, prefill / cached / uncached.
    On the layout's device (fp32)."""
    world, device = layout.world_size, layout.collective_device
    sub = init_layout(ParallelConfig(sp=world), layout.device)
    model = tiny_model().to(device)
    errors = {}
    for edit in (False, True):
        inputs = case_inputs(edit, device)
        blocks = BlockCausalLayout.build(
            inputs["lens"],
            inputs["grids"],
            text_width=inputs["text"].shape[1],
            slot_masks=inputs["slots"],
            device=device,
        )
        for kernels in ("off", "on"):
            model.set_row_kernels(kernels)
            for impl_name, make in impls:
                with torch.no_grad():
                    expected = _model_steps(model, inputs, blocks, make(), None)
                    got = _model_steps(model, inputs, blocks, make(), sub)
                for step, a, b in zip(("prefill", "cached", "uncached"), got, expected, strict=True):
                    name = f"ulysses{world}/{'edit' if edit else 't2i'}/kernels-{kernels}/{impl_name}/{step}"
                    errors[name] = (a - b).abs().max().item()
    model.set_row_kernels("auto")
    return errors


def _conditioning(inputs: dict, edit: bool) -> QwenImage21Conditioning:
    """The family's conditioning of a guided request: both prompts packed, each alone, empty caches."""
    text, lens, slots = inputs["text"], inputs["lens"], inputs["slots"]

    def branch(rows: slice, key: str) -> Branch21:
        part = [lens[i] for i in range(2)[rows]]
        width = max(part)
        masks = None if slots is None else slots[rows, :width]
        built = BlockCausalLayout.build(part, inputs["grids"], text_width=width, slot_masks=masks)
        return Branch21(text[rows, :width], built, key)

    halves = (branch(slice(0, 1), "half0"), branch(slice(1, 2), "half1"))
    condition = inputs["latents"][0][:1, : CONDITION[1] * CONDITION[2]] if edit else None
    return QwenImage21Conditioning(branch(slice(0, 2), "both"), halves, condition, {})


def _guided_steps(model, inputs, edit, layout: ParallelLayout, cfg: str) -> list[torch.Tensor]:
    """Two guided steps' predictions [1, N, C] through pipelines.denoise.predict_noise and the family's
    call/guide hooks (one fresh conditioning, so the first step fills the caches the second reads)."""
    hooks = QwenImage21Hooks()
    models = DenoiseModels(
        (model,), SDPAImpl(), layout, ResidentPlacement(), torch.float32, call=hooks.call, guide=hooks.guide
    )
    conditioning = _conditioning(inputs, edit)
    steps = plan_steps(torch.tensor(TIMESTEPS), (GUIDANCE,))
    target = TARGET[1] * TARGET[2]
    return [
        predict_noise(latents[:1, -target:], step, conditioning, models, DenoiseOptions(cfg=cfg))
        for latents, step in zip(inputs["latents"], steps, strict=True)
    ]


def cfg_layouts(layout: ParallelLayout) -> dict[str, float]:
    """CFG parallel (x Ulysses on the rest of the world) against one process's sequential CFG."""
    world = layout.world_size
    config = ParallelConfig(sp=world // 2, cfg=True)
    model = tiny_model()
    errors = {}
    for edit in (False, True):
        inputs = case_inputs(edit)
        with torch.no_grad():
            expected = _guided_steps(model, inputs, edit, ParallelLayout.single(), "sequential")
            got = _guided_steps(model, inputs, edit, init_layout(config), "batch")
        for step, a, b in zip(("prefill", "cached"), got, expected, strict=True):
            errors[f"cfg2 x sp{config.sp}/{'edit' if edit else 't2i'}/{step}"] = (a - b).abs().max().item()
    return errors


def everything(layout: ParallelLayout) -> dict[str, float]:
    return {**model_layouts(layout), **cfg_layouts(layout)}


def cuda_model_errors(layout: ParallelLayout) -> dict[str, float]:
    """model_layouts on the ranks' GPUs (NCCL), SDPA; the row kernels 'on' run the Triton kernels there."""
    return model_layouts(layout, impls=IMPLS[:1])


def generate_latents(layout: ParallelLayout | None, model_dir, edit: bool) -> torch.Tensor:
    """Final latents [1, C, 1, h, w] of a guided 2-step generation of the tiny directory (layout None:
    one process): text-to-image through from_pretrained(parallel=), an edit (condition images at 64 x 64
    pixels) through the constructor."""
    import numpy as np

    from mmgen.loading.qwen_image21_dir import load_qwen_image21_components
    from pipelines.qwen_image21_family import QwenImage21FamilyPipeline

    common = {"guidance_scale": GUIDANCE, "num_inference_steps": 2, "seed": 7, "progress": False}
    if not edit:
        pipe = QwenImage21FamilyPipeline.from_pretrained(model_dir, dtype="float32", parallel=layout)
        return pipe("a red kite", "blurry", height=64, width=96, **common).latents
    parts = load_qwen_image21_components(model_dir, dtype=torch.float32)
    pipe = QwenImage21FamilyPipeline(parts, condition_resolution=64, layout=layout)
    pixels = (np.random.RandomState(0).rand(80, 64, 3) * 255).astype(np.uint8)
    return pipe("make it blue", "dark", image=pixels, **common).latents


def graph_replays_equal(layout: ParallelLayout | None) -> dict[str, bool]:
    """The cached steps replayed as CUDA graphs (mmgen.models.step_graph.StepGraphs: the first cached
    call eager, the second captured, the rest replayed) against eager calls on a cache of their own:
    {case: bitwise equal at every step}. One GPU (layout None) or Ulysses over the world's GPUs (NCCL:
    the exchanges run between the pieces). The row kernels (Triton) on; SDPA (fp32 and bf16) and, where
    installed, FlashAttention (bf16); text-to-image and an edit."""
    from mmgen.kernels.fa_providers import installed_gpu_providers
    from mmgen.models.step_graph import StepGraphs

    device = torch.device("cuda") if layout is None else layout.device
    parallel = None if layout is None else init_layout(ParallelConfig(sp=layout.world_size), layout.device)
    impls = [("sdpa", SDPAImpl)] + [
        (name, lambda n=name: FlashAttentionImpl(n)) for name in installed_gpu_providers()[:1]
    ]
    timesteps = (900.0, 700.0, 500.0, 300.0, 100.0)  # the prefill, then 4 cached steps
    equal = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model().to(device, dtype).set_row_kernels("on")
        for edit in (False, True):
            inputs = case_inputs(edit, device)
            blocks = BlockCausalLayout.build(
                inputs["lens"], inputs["grids"], text_width=inputs["text"].shape[1], slot_masks=inputs["slots"],
                device=device,
            )  # fmt: skip
            target = blocks.target_tokens
            for impl_name, make in impls if dtype == torch.bfloat16 else impls[:1]:  # FlashAttention: 16-bit
                impl, eager_cache, graph_cache, graphs = make(), PrefixCache(), PrefixCache(), StepGraphs()
                same = True
                with torch.no_grad():
                    for step, t in enumerate(timesteps):
                        g = torch.Generator().manual_seed(step)
                        latents = torch.randn(2, blocks.latent_tokens, TINY.in_channels, generator=g).to(
                            device, dtype
                        )
                        timestep = torch.full((2,), t / 1000, device=device)
                        common = {"metadata": blocks, "attention": impl, "parallel": parallel}
                        if step == 0:
                            text = inputs["text"].to(dtype)
                            model(latents, timestep, text, cache=eager_cache, **common)
                            model(latents, timestep, text, cache=graph_cache, **common)
                            continue
                        latents = latents[:, -target:]
                        expected = model(latents, timestep, None, cache=eager_cache, **common)

                        def forward(x, t, collective, model=model, cache=graph_cache, common=common):
                            return model(x, t, None, cache=cache, collective=collective, **common)

                        got = graphs("both", forward, latents, timestep)
                        same = same and torch.equal(got, expected)
                name = f"{'edit' if edit else 't2i'}/{impl_name}/{str(dtype).removeprefix('torch.')}"
                equal[name] = same and graphs.captured == 1
    return equal


def kept_graph_requests(
    layout: ParallelLayout | None, device: torch.device | str = "cuda"
) -> dict[str, object]:
    """Two requests of one signature (other prompts' text, other noise, layouts built apart) through one
    kept store (StepGraphs(kept=...), as a pipeline keeps them): the first warms up and captures, the
    second replays that capture from its first cached step with its own prefix cache copied into the
    kept one. Against eager calls on each request's own cache: {check: value}. One process (layout
    None) or Ulysses over the world's ranks."""
    from mmgen.models.step_graph import GraphSignature, StepGraphs

    device = torch.device(device) if layout is None else layout.device
    parallel = None if layout is None else init_layout(ParallelConfig(sp=layout.world_size), layout.device)
    model = tiny_model().to(device)
    if device.type == "cuda":
        model = model.set_row_kernels("on")
    inputs = case_inputs(True, device)  # an edit: condition tokens in the prefix too
    timesteps = (900.0, 700.0, 500.0, 300.0, 100.0)  # the prefill, then 4 cached steps
    store: dict = {}
    found: dict[str, object] = {}
    for request in range(2):
        blocks = BlockCausalLayout.build(
            inputs["lens"], inputs["grids"], text_width=inputs["text"].shape[1], slot_masks=inputs["slots"],
            device=device,
        )  # fmt: skip
        g = torch.Generator().manual_seed(10 + request)
        text = torch.randn(inputs["text"].shape, generator=g).to(device)
        eager_cache, cache, graphs = PrefixCache(), PrefixCache(), StepGraphs(kept=store)
        common = {"metadata": blocks, "attention": SDPAImpl(), "parallel": parallel}
        same = True
        with torch.no_grad():
            for step, t in enumerate(timesteps):
                latents = torch.randn(2, blocks.latent_tokens, TINY.in_channels, generator=g).to(device)
                timestep = torch.full((2,), t / 1000, device=device)
                if step == 0:
                    model(latents, timestep, text, cache=eager_cache, **common)
                    model(latents, timestep, text, cache=cache, **common)
                    continue
                latents = latents[:, -blocks.target_tokens :]
                expected = model(latents, timestep, None, cache=eager_cache, **common)

                def forward(x, t, collective, cache=cache, common=common):
                    return model(x, t, None, cache=cache, collective=collective, **common)

                def signature(blocks=blocks, inputs=(latents, timestep)):
                    return GraphSignature.of(blocks.signature, (), inputs)

                got = graphs(
                    "both", forward, latents, timestep, signature=signature, state=cache, reads=(blocks,)
                )
                same = same and torch.equal(got, expected)
        found[f"request {request} equals eager"] = same
        found[f"request {request} warm-up calls"] = len(graphs.warmed)
        found[f"request {request} replays the kept graph"] = graphs.graphs["both"] is store["both"].graph
    return found
