"""Functions the parallel tests run on every spawned rank (module-level so they pickle).

Each builds its inputs from a fixed seed, so every rank holds the same full tensors and weights;
it runs the parallel path on its shard, gathers, and returns (rank 0) the max abs difference from
the single-process result computed in the same process.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from mmgen.attention import FlashAttentionImpl, SDPAImpl
from mmgen.errors import ValidationError
from mmgen.models.settings import ExecutionSettings
from mmgen.models.wan import WanConfig, WanDiT
from mmgen.parallel.attention import SequenceParallelAttention
from mmgen.parallel.launch import run_parallel
from mmgen.parallel.layout import ParallelConfig, ParallelLayout, init_layout, warm_up
from mmgen.parallel.sequence import SequenceShard
from pipelines.denoise import (
    Conditioning,
    DenoiseModels,
    DenoiseOptions,
    ResidentPlacement,
    TextBranch,
    plan_steps,
    predict_noise,
    split_branches,
)

TINY = WanConfig(
    num_attention_heads=4,
    attention_head_dim=8,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=16,
    ffn_dim=32,
    num_layers=2,
    rope_max_seq_len=32,
    text_len=8,
)
GUIDANCE = 5.0
IMPLS = (("sdpa", SDPAImpl), ("reference", lambda: FlashAttentionImpl("reference")))


def run_forked(fn, config: ParallelConfig, *args, **kwargs):
    """run_parallel(fn, config, *args) on forked workers (they start in milliseconds), each on one torch
    thread (launch.World.forked: libgomp's pool does not survive fork). The results are compared with
    tolerances, or with a single-process result computed in the same child, so its thread count does
    not matter."""
    return run_parallel(fn, config, *args, start_method="fork", **kwargs)


def attention_case(layout: ParallelLayout, tokens: int, heads: int, impl) -> float:
    """Max |SP attention gathered - one-process attention| over q/k/v [2, tokens, heads, 8] fp32."""
    g = torch.Generator().manual_seed(tokens * 31 + heads)
    q, k, v = (torch.randn(2, tokens, heads, 8, generator=g) for _ in range(3))
    expected = impl(
        q, k, v, SequenceShard.plan(tokens, ParallelLayout.single()).metadata(2, q.device).gathered
    )
    shard = SequenceShard.plan(tokens, layout)
    local = SequenceParallelAttention(impl, layout)(
        shard.split(q), shard.split(k), shard.split(v), shard.metadata(2, q.device)
    )
    return (shard.gather(local) - expected).abs().max().item()


def attention_layouts(layout: ParallelLayout) -> dict[str, float]:
    """Ulysses, Ring and Ulysses x Ring over the whole world, divisible and padded token counts."""
    world = layout.world_size
    configs = {
        f"ulysses{world}": ParallelConfig(sp=world),
        f"ring{world}": ParallelConfig(sp=world, ring=world),
    }
    if world == 4:
        configs["ulysses2xring2"] = ParallelConfig(sp=4, ring=2)
    errors = {}
    for name, config in configs.items():
        sub = init_layout(config)
        # A ring alone takes any head count. Ulysses: 4 heads, and 8, so that every world size has
        # ranks holding several heads (a head-order slip inside a rank's group shows at 2 and 4).
        for heads in (4, 8) if config.ulysses > 1 else (3,):
            for impl_name, make in IMPLS:
                for tokens in (4 * world, 4 * world + 1):
                    errors[f"{name}/{impl_name}/S={tokens}/H={heads}"] = attention_case(
                        sub, tokens, heads, make()
                    )
    return errors


def tiny_dit(config: WanConfig = TINY) -> WanDiT:
    torch.manual_seed(0)
    return WanDiT(config).eval()


def dit_layouts(layout: ParallelLayout) -> dict[str, float]:
    """The whole DiT with parallel=..., per SP layout and grid (divisible and not), against parallel=None."""
    world = layout.world_size
    configs = {f"sp{world}": ParallelConfig(sp=world)}
    if world == 4:
        configs["ulysses2xring2"] = ParallelConfig(sp=4, ring=2)
    errors = {}
    for heads in (TINY.num_attention_heads, 8):
        errors.update(_dit_errors(configs, replace(TINY, num_attention_heads=heads), heads))
    return errors


def _dit_errors(configs: dict[str, ParallelConfig], dit: WanConfig, heads: int) -> dict[str, float]:
    """dit_layouts for one DiT config; names carry '/H=<heads>' past the default 4 heads."""
    model = tiny_dit(dit)
    g = torch.Generator().manual_seed(5)
    text = torch.randn(1, 8, dit.text_dim, generator=g)
    suffix = "" if heads == TINY.num_attention_heads else f"/H={heads}"
    errors = {}
    for shape in ((1, 4, 2, 4, 8), (1, 4, 3, 6, 10)):  # 16 and 45 tokens
        latents = torch.randn(shape, generator=g)
        tokens = shape[2] * shape[3] * shape[4] // 4
        # One timestep per sample, and one per token (Wan2.2 TI2V: 0 on the first latent frame's tokens)
        per_token = torch.full((1, tokens), 700.0)
        per_token[:, : tokens // shape[2]] = 0.0
        for kind, t in (("", torch.tensor([700.0])), ("per-token/", per_token)):
            with torch.no_grad():
                expected = model(latents, t, text, attention=SDPAImpl())
                for name, config in configs.items():
                    got = model(latents, t, text, attention=SDPAImpl(), parallel=init_layout(config))
                    error = (got - expected).abs().max().item()
                    errors[f"{name}/{kind}grid{tuple(shape[2:])}{suffix}"] = error
    return errors


def cfg_layouts(layout: ParallelLayout) -> dict[str, float]:
    """One guided step through pipelines.denoise.predict_noise: CFG parallel (x SP) against one process."""
    world = layout.world_size
    configs = {"cfg2": ParallelConfig(sp=world // 2, cfg=True)}
    model = tiny_dit()
    g = torch.Generator().manual_seed(9)
    text = torch.randn(2, 8, TINY.text_dim, generator=g)
    metadata = WanDiT.build_attention_metadata()
    both = TextBranch(text, metadata)
    conditioning = Conditioning(both, split_branches(both, lambda row: metadata))
    latents = torch.randn(1, 4, 3, 6, 10, generator=g)
    step = plan_steps(torch.tensor([800.0]), (GUIDANCE,))[0]
    errors = {}
    with torch.no_grad():
        single = DenoiseModels(
            (model,), SDPAImpl(), ParallelLayout.single(), ResidentPlacement(), torch.float32
        )
        expected = predict_noise(latents, step, conditioning, single, DenoiseOptions(cfg="sequential"))
        for name, config in configs.items():
            models = DenoiseModels(
                (model,), SDPAImpl(), init_layout(config), ResidentPlacement(), torch.float32
            )
            got = predict_noise(latents, step, conditioning, models, DenoiseOptions())
            errors[f"{name} x sp{config.sp}"] = (got - expected).abs().max().item()
    return errors


class RowCountedProjection(torch.nn.Linear):
    """A linear layer whose output moves with its call's row count, as a GPU's can: cuBLAS picks a GEMM's
    kernel by its rows, and a split-K kernel sums in another order (benchmarks/gemm_rows.py). Here by
    1e-3 x the call's rows, so a call on other rows than one process's shows at any thread count."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return super().forward(h) + 1e-3 * h.shape[:-1].numel()


def head_layouts(layout: ParallelLayout) -> dict[str, float]:
    """The DiT under Ulysses over the world with a RowCountedProjection as its output projection, whole and
    under block chunks, against one process: equal only where every rank projects the whole sequence in
    one process's calls."""
    world = layout.world_size
    model = tiny_dit()
    counted = RowCountedProjection(model.proj_out.in_features, model.proj_out.out_features)
    counted.load_state_dict(model.proj_out.state_dict())
    model.proj_out = counted
    sp = init_layout(ParallelConfig(sp=world))
    g = torch.Generator().manual_seed(6)
    text = torch.randn(1, 8, TINY.text_dim, generator=g)
    latents = torch.randn((1, 4, 3, 6, 10), generator=g)  # 45 tokens: padded shards, two chunks and a part
    errors = {}
    for chunk in (None, 16):
        settings = ExecutionSettings(block_chunk=chunk)
        inputs = (latents, torch.tensor([700.0]), text)
        with torch.no_grad():
            expected = model(*inputs, attention=SDPAImpl(), settings=settings)
            got = model(*inputs, attention=SDPAImpl(), settings=settings, parallel=sp)
        errors[f"head/sp{world}/chunk={chunk}"] = (got - expected).abs().max().item()
    return errors


def everything(layout: ParallelLayout) -> dict[str, float]:
    return {**attention_layouts(layout), **dit_layouts(layout), **cfg_layouts(layout), **head_layouts(layout)}


def warm_up_exchanges(layout: ParallelLayout) -> dict[str, tuple[dict[str, int], list[int]]]:
    """Per layout of the world: (warm_up's {role: ranks}, the group sizes of the all-to-alls that
    init_layout itself ran before returning, sorted), counted by wrapping dist.all_to_all_single."""
    world = layout.world_size
    configs = {f"ulysses{world}": ParallelConfig(sp=world)}
    if world == 4:
        configs |= {
            "cfg2xulysses2": ParallelConfig(sp=2, cfg=True),
            "ulysses2xring2": ParallelConfig(sp=4, ring=2),
        }
    real = dist.all_to_all_single
    sizes: list[int] = []

    def counted(output, tensor, *args, group=None, **kwargs):
        sizes.append(dist.get_world_size(group))
        return real(output, tensor, *args, group=group, **kwargs)

    found = {}
    dist.all_to_all_single = counted  # this forked child's own torch.distributed
    try:
        for name, config in configs.items():
            sizes.clear()
            built = init_layout(config)
            during = sorted(sizes)
            found[name] = (warm_up(built), during)
    finally:
        dist.all_to_all_single = real
    return found


def failing_rank(layout: ParallelLayout) -> None:
    """Rank 1 fails while rank 0 waits in a collective (it would wait for the full timeout)."""
    if layout.rank == 1:
        raise ValidationError("job 'x': frames 6 must be 4k+1 (rank 1 validated it)")
    dist.all_reduce(torch.ones(1))
    time.sleep(60)


def generate_latents(layout: ParallelLayout | None, model_dir, offload: str | None = None) -> torch.Tensor:
    """Final latents of a 2-step guided generation with the default model (layout None = one process)."""
    from pipelines.wan_t2v import WanT2VPipeline

    pipe = WanT2VPipeline.from_pretrained(model_dir, parallel=layout, offload=offload)
    result = pipe("a red fox", num_frames=5, num_inference_steps=2, seed=3, progress=False)
    return result.latents


VAE_LATENTS = (
    1,
    4,
    2,
    2,
    32,
)  # [1, z_dim, F', H', W']: 5 frames of 16 x 256 pixels (bands narrower than the halo)


def tiny_vae():
    """A Wan2.1-structured AutoencoderKLWan (4 up blocks, 2 temporal upsamples) small enough for CPU tests."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    ).eval()


def vae_latents() -> torch.Tensor:
    return torch.randn(VAE_LATENTS, generator=torch.Generator().manual_seed(11)) * 2


def float_frames(video: torch.Tensor) -> np.ndarray:
    """Decoded [1, 3, T, H, W] -> float32 frames [T, H, W, 3] (the values before the uint8 rounding)."""
    return video[0].permute(1, 2, 3, 0).float().numpy()


def split_decode_frames(layout: ParallelLayout) -> tuple[np.ndarray, np.ndarray]:
    """The tiny VAE's frames decoded in bands over the world: (float32, uint8), each [T, H, W, 3]."""
    from mmgen.parallel.vae_decode import split_decode
    from pipelines.common import video_to_uint8

    vae, z = tiny_vae(), vae_latents()
    return split_decode(vae, z, layout, float_frames), split_decode(vae, z, layout, video_to_uint8)


def spread_bands_frames(layout: ParallelLayout, bands: int) -> tuple[np.ndarray, np.ndarray]:
    """The tiny VAE's float32 frames decoded as `bands` bands spread over the world, and the same
    bands decoded one after another in this rank alone (same process, same threads): both [T, H, W, 3]."""
    from mmgen.parallel.vae_decode import decode_in_bands, spread_bands

    vae, z = tiny_vae(), vae_latents()
    return spread_bands(vae, z, bands, layout, float_frames), decode_in_bands(vae, z, bands, float_frames)


def generate_frames(layout: ParallelLayout | None, model_dir, decode: str) -> np.ndarray:
    """uint8 frames of a 2-step guided generation with the default model under a decode mode."""
    from pipelines.wan_t2v import WanT2VPipeline

    pipe = WanT2VPipeline.from_pretrained(model_dir, parallel=layout)
    kwargs = {"num_frames": 5, "num_inference_steps": 2, "seed": 3, "progress": False}
    return pipe("a red fox", decode=decode, width=96, **kwargs).frames


def default_decode_frames(
    layout: ParallelLayout | None, model_dir, cfg: str | None
) -> tuple[np.ndarray, int]:
    """uint8 frames of the 2-step guided generation under the default decode (every rank decodes the
    whole frames), and how many of the world's ranks hold exactly rank 0's frames (sha256)."""
    from pipelines.wan_t2v import WanT2VPipeline

    pipe = WanT2VPipeline.from_pretrained(model_dir, parallel=layout)
    kwargs = {"num_frames": 5, "num_inference_steps": 2, "seed": 3, "progress": False, "width": 96}
    frames = pipe("a red fox", cfg=cfg, **kwargs).frames
    if layout is None or layout.is_single:
        return frames, 1
    digests: list = [None] * layout.world_size
    dist.all_gather_object(digests, hashlib.sha256(frames.tobytes()).hexdigest(), group=layout.world_group)
    return frames, digests.count(digests[0])


@dataclass(frozen=True)
class SharedExample:
    """A value of the shapes a family's encode_text returns (pipelines.qwen_image21.PromptBatch's kinds)."""

    states: torch.Tensor
    lengths: tuple[int, ...]
    slots: torch.Tensor
    extra: list


def shared_values(layout: ParallelLayout) -> tuple[list, bool, list[str]]:
    """Every rank's copy of rank 0's SharedExample through from_first_rank, whether rank 0 got its own
    object back, and then each rank's error when rank 0's compute raises (the world still usable after)."""
    from mmgen.parallel.share import from_first_rank

    made: list = []

    def example() -> SharedExample:
        g = torch.Generator().manual_seed(5)
        made.append(
            SharedExample(
                states=torch.randn(2, 7, 3, generator=g),
                lengths=(7, 4),
                slots=torch.rand(2, 7, generator=g) > 0.5,
                extra=["text", None, (torch.arange(3), 2.5)],
            )
        )
        return made[-1]

    got = from_first_rank(example, layout)
    assert len(made) == (1 if layout.rank == 0 else 0)  # only rank 0 computes
    copies: list = [None] * layout.world_size
    dist.all_gather_object(copies, got, group=layout.world_group)

    def failing() -> None:
        raise ValidationError("prompt: too long for the text encoder")

    try:
        from_first_rank(failing, layout)
        mine = "no error"
    except ValidationError as error:
        mine = f"ValidationError: {error}"
    errors: list = [None] * layout.world_size
    dist.all_gather_object(errors, mine, group=layout.world_group)
    return copies, bool(made) and got is made[0], errors


def text_encoder_holders(
    layout: ParallelLayout, model_dir
) -> list[tuple[bool, int, object, str | None, str]]:
    """Per rank of a world loading the default model: (its text encoder's weights are all on the meta
    device, the encoder's bytes, the memory plan of one request, the encoder's state_digest where it is
    kept, its DiT's state_digest)."""
    from mmgen.placement.tensors import module_bytes
    from pipelines.plan import prepare
    from pipelines.request import GenerationRequest
    from pipelines.wan_t2v import WanT2VPipeline

    pipe = WanT2VPipeline.from_pretrained(model_dir, parallel=layout)
    encoder = pipe.components.text_encoder
    request = GenerationRequest.from_pipeline_call(
        "a red fox", None, num_frames=5, num_inference_steps=2, seed=3
    )
    plan = prepare(request, pipe).memory
    on_meta = all(t.is_meta for t in encoder.state_dict().values())
    kept = None if on_meta else state_digest(encoder)
    mine = (on_meta, module_bytes(encoder), plan, kept, state_digest(pipe.transformer))
    held: list = [None] * layout.world_size
    dist.all_gather_object(held, mine, group=layout.world_group)
    return held


def state_digest(module: torch.nn.Module) -> str:
    """sha256 over a module's state dict: every name, dtype, shape and byte."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def split_reads_round_trip(layout: ParallelLayout, board=None, loads: int = 1) -> list[tuple]:
    """A world's SplitReads of a toy encoder (rank 0's alone, larger than the transformer) and transformer
    read from one seeded checkpoint, each rank loading its pieces (taken from `board`, a
    read_board.ReadBoard, when given; else the fixed split), then share_reads; `loads` times with the
    same board. Per rank, every rank's on rank 0: ("equal" / "meta" / "differs" for its encoder, the same
    for its transformer, the encoder's pieces it read), or its error's line."""
    from mmgen.parallel.launch import PendingLayout

    try:
        for _ in range(loads):
            # as a started rank's loader sees its world: a PendingLayout with the world's board
            mine = _split_load(layout, PendingLayout(layout.world_size, layout.rank, lambda: layout, board))
    except Exception as error:  # noqa: BLE001 - the test reads every rank's line
        mine = f"{type(error).__name__}: {error}"
    every: list = [None] * layout.world_size
    dist.all_gather_object(every, mine, group=layout.world_group)
    return every


def _split_load(layout: ParallelLayout, where) -> tuple:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix=f"mmgen-split-{layout.rank}-") as written:
        return _split_load_in(layout, where, Path(written))


def _split_load_in(layout: ParallelLayout, where, written) -> tuple:
    """_split_load with the checkpoints written into the directory `written`."""
    from safetensors.torch import save_file

    from mmgen.loading.safetensors_dir import load_into_module, read_tensors
    from mmgen.parallel.share import ReadPart, SplitReads, share_reads

    def build(seed: int, widths: list[int]) -> tuple[torch.nn.Module, dict]:
        with torch.device("meta"):
            module = torch.nn.Sequential(*(torch.nn.Linear(16, w) for w in widths))
        generator = torch.Generator().manual_seed(seed)
        values = {name: torch.randn(t.shape, generator=generator) for name, t in module.state_dict().items()}
        return module, values

    modules, checkpoints, files = {}, {}, {}
    for name, seed, widths in (("text_encoder", 1, [96, 80, 64, 72, 88]), ("transformer", 2, [24, 16, 40])):
        modules[name], checkpoints[name] = build(seed, widths)
        files[name] = written / f"{name}.safetensors"  # the loaders read pieces from the file's bytes
        save_file(checkpoints[name], str(files[name]))
    parts = [
        ReadPart(name, sum(4 * v.numel() for v in c.values()), name != "text_encoder")
        for name, c in checkpoints.items()
    ]
    split = SplitReads.over(where, parts)
    for name, module in modules.items():
        load_into_module(
            module,
            {key: (tensor, files[name]) for key, (tensor, _) in read_tensors([files[name]]).items()},
            source=files[name],
            dtype=torch.float32,
            device=layout.collective_device,  # a GPU under NCCL
            read=split.reads()[name],
            keep_unread=layout.rank == 0 or name != "text_encoder",
        )
    share_reads(split, modules, layout)

    def verdict(name: str) -> str:
        state = modules[name].state_dict()
        if all(t.is_meta for t in state.values()):
            return "meta"
        same = all(torch.equal(state[key].cpu(), value) for key, value in checkpoints[name].items())
        return "equal" if same else "differs"

    return verdict("text_encoder"), verdict("transformer"), sorted(split.taken["text_encoder"])


def mismatched_weights(layout: ParallelLayout) -> list[str]:
    """share_reads between modules of different shapes (rank 1's second layer wider): each rank's error."""
    from mmgen.parallel.share import ReadPart, SplitReads, share_reads

    width = 5 if layout.rank == 1 else 4
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, width))
    split = SplitReads.over(layout, [ReadPart("transformer", 128)])
    try:
        share_reads(split, {"transformer": module}, layout)
    except Exception as error:  # noqa: BLE001 - the test reads every rank's line
        message = f"{type(error).__name__}: {error}"
    else:
        message = "no error"
    lines: list = [None] * layout.world_size
    dist.all_gather_object(lines, message, group=layout.world_group)
    return lines
