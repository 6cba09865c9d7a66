"""The Wan DiT (Wan2.1 T2V / I2V, Wan2.2 A14B experts and TI2V-5B) with explicit attention metadata.

Shapes: latents [B, C, F, H, W] -> patches of (pt, ph, pw) -> S = F/pt * H/ph * W/pw tokens of width
dim = heads * head_dim; text [B, L, text_dim]; output [B, C_out, F, H, W].

Variants are config values: `image_dim` / `added_kv_proj_dim` add the image path of Wan2.1 I2V
(image-encoder tokens [B, N, image_dim] embedded and attended in each cross-attention through its
own key/value projections); a timestep per token ([B, S], Wan2.2 TI2V) modulates every token
separately: the few distinct timesteps are embedded once per call, and every block reads each
token's modulation through an index (mmgen.layers.modulation). Image-conditioned Wan2.2 models (I2V-A14B, TI2V-5B) have no image path: their image
enters as latents concatenated to the noise or blended into it.

Text attention: Wan2.1 was trained with every prompt's embeddings zero-padded to `text_len` (512)
tokens and attended densely, without a mask. `forward` reproduces that when `text_lens` is None (the
padding tokens are attended on purpose). Given `text_lens`, cross-attention keys are limited to each
prompt's length instead (varlen metadata); `WanConfig.text_mask` records which one a checkpoint wants.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn

from mmgen.attention.impls import AttentionImpl
from mmgen.attention.metadata import AttentionMetadata, DiTAttention
from mmgen.errors import ValidationError
from mmgen.layers.embeddings import patch_tokens, unpatchify
from mmgen.layers.fp8_linear import check_fp8_device
from mmgen.layers.fused_norms import layer_norm_modulate
from mmgen.layers.modulation import distinct_timesteps, modulation_vectors, scale_shift_table
from mmgen.layers.norms import FP32LayerNorm
from mmgen.layers.rotary import rope_3d_tables
from mmgen.models.settings import ExecutionSettings
from mmgen.models.wan_blocks import WanBlock, WanCall, WanConditionEmbedder
from mmgen.parallel.layout import ParallelLayout
from mmgen.parallel.sequence import SequenceShard, shard_dit_inputs

QK_NORM = "rms_norm_across_heads"
# diffusers keys of the image path (Wan2.1 I2V / FLF2V); null in text-only configs.
IMAGE_FIELDS = ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len")
# Wan2.1 I2V's image encoder (open-clip ViT-H/14) gives 257 tokens of width 1280.
CLIP_IMAGE_DIM = 1280
CLIP_IMAGE_TOKENS = 257
# Modules diffusers keeps in float32 whatever the load dtype (its _keep_in_fp32_modules, by name part).
FP32_MODULES = frozenset({"time_embedder", "scale_shift_table", "norm1", "norm2", "norm3"})
POSITIVE_FIELDS = (
    *("num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim"),
    *("freq_dim", "ffn_dim", "num_layers", "rope_max_seq_len", "text_len"),
)
# The fields of the original Wan repo's config.json that from_original_config reads or checks.
ORIGINAL_FIELDS = frozenset(
    {"dim", "ffn_dim", "num_heads", "num_layers", "in_dim", "out_dim", "text_len", "freq_dim", "eps"}
    | {"model_type", "patch_size", "text_dim", "window_size", "qk_norm", "cross_attn_norm"}
)
ORIGINAL_MODEL_TYPES = ("t2v", "i2v", "ti2v", "flf2v")


@dataclass(frozen=True)
class WanConfig:
    """Architecture of a Wan text-to-video DiT; field names and meanings are diffusers' WanTransformer3DModel's.

    text_len and text_mask are mmgen's own (not in diffusers configs): the padded prompt length and
    whether cross-attention masks the padding (False for Wan2.1, trained without a mask).
    image_dim / added_kv_proj_dim (both or neither) / pos_embed_seq_len: the image path (Wan2.1 I2V).
    """

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 12
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 8960
    num_layers: int = 30
    cross_attn_norm: bool = True
    qk_norm: str = QK_NORM
    eps: float = 1e-6
    rope_max_seq_len: int = 1024
    text_len: int = 512
    text_mask: bool = False
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    pos_embed_seq_len: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise ValidationError(f"WanConfig.patch_size must be 3 positive ints, got {self.patch_size}")
        for name in POSITIVE_FIELDS:
            _require_positive(name, getattr(self, name))
        if self.attention_head_dim % 2:
            raise ValidationError(
                f"WanConfig.attention_head_dim must be even (rotary pairs), got {self.attention_head_dim}"
            )
        if self.qk_norm != QK_NORM:
            raise ValidationError(
                f"WanConfig.qk_norm {self.qk_norm!r} is not supported; allowed: {QK_NORM!r}"
            )
        if not self.eps > 0:
            raise ValidationError(f"WanConfig.eps must be > 0, got {self.eps}")
        for name in IMAGE_FIELDS:
            if getattr(self, name) is not None:
                _require_positive(name, getattr(self, name))
        if (self.image_dim is None) != (self.added_kv_proj_dim is None):
            raise ValidationError(
                f"WanConfig.image_dim={self.image_dim} and added_kv_proj_dim={self.added_kv_proj_dim}: "
                "set both (an image path) or neither"
            )
        if self.pos_embed_seq_len is not None and self.image_dim is None:
            raise ValidationError("WanConfig.pos_embed_seq_len needs image_dim (it positions image tokens)")

    @property
    def has_image_path(self) -> bool:
        """Whether the model attends to image-encoder tokens (Wan2.1 I2V / FLF2V)."""
        return self.image_dim is not None

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @staticmethod
    def wan21_t2v_1_3b() -> WanConfig:
        """Wan2.1 T2V 1.3B: dim 1536, 12 heads, 30 layers."""
        return WanConfig(num_attention_heads=12, ffn_dim=8960, num_layers=30)

    @staticmethod
    def wan21_t2v_14b() -> WanConfig:
        """Wan2.1 T2V 14B: dim 5120, 40 heads, 40 layers."""
        return WanConfig(num_attention_heads=40, ffn_dim=13824, num_layers=40)

    @staticmethod
    def wan21_i2v_14b() -> WanConfig:
        """Wan2.1 I2V 14B: the 14B DiT with 36 input channels and the CLIP image path."""
        return WanConfig(
            num_attention_heads=40,
            ffn_dim=13824,
            num_layers=40,
            in_channels=36,
            out_channels=16,
            image_dim=CLIP_IMAGE_DIM,
            added_kv_proj_dim=5120,
        )

    @staticmethod
    def wan22_t2v_a14b() -> WanConfig:
        """One expert of Wan2.2 T2V-A14B (both experts share this architecture)."""
        return WanConfig(num_attention_heads=40, ffn_dim=13824, num_layers=40)

    @staticmethod
    def wan22_i2v_a14b() -> WanConfig:
        """One expert of Wan2.2 I2V-A14B: 36 input channels (noise, mask, image latents), no image path."""
        return WanConfig(
            num_attention_heads=40, ffn_dim=13824, num_layers=40, in_channels=36, out_channels=16
        )

    @staticmethod
    def wan22_ti2v_5b() -> WanConfig:
        """Wan2.2 TI2V-5B: dim 3072, 24 heads, 30 layers, 48 latent channels (the Wan2.2 VAE)."""
        return WanConfig(
            num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48
        )

    @staticmethod
    def from_diffusers_config(raw: dict) -> WanConfig:
        """From a diffusers transformer/config.json dict; unknown keys raise."""
        known = {f.name for f in fields(WanConfig)} - {"text_len", "text_mask"}
        values = {}
        for key, value in raw.items():
            if key.startswith("_"):
                continue  # _class_name, _diffusers_version, _name_or_path
            if key not in known:
                raise ValidationError(f"unknown Wan config field {key!r}; known: {', '.join(sorted(known))}")
            values[key] = value
        if values.get("out_channels") is None:  # diffusers: out_channels = out_channels or in_channels
            values["out_channels"] = values.get("in_channels", WanConfig.in_channels)
        if "qk_norm" in values and values["qk_norm"] is None:
            raise ValidationError(f"Wan config qk_norm=null is not supported; allowed: {QK_NORM!r}")
        return WanConfig(**values)

    def to_diffusers_config(self) -> dict:
        """The diffusers WanTransformer3DModel config dict (without mmgen's text_len / text_mask)."""
        raw = asdict(self)
        del raw["text_len"], raw["text_mask"]
        raw["patch_size"] = list(self.patch_size)
        return raw

    @staticmethod
    def from_original_config(raw: dict, *, has_image_embedding: bool = False) -> WanConfig:
        """From the original Wan repo's config.json (dim, num_heads, in_dim, ...).

        model_type t2v / i2v / ti2v / flf2v. Wan2.1's i2v checkpoints carry the CLIP image path
        (img_emb.* weights) and Wan2.2's do not, under the same model_type: the caller says which
        (`has_image_embedding`, from the weight names).
        """
        model_type = raw.get("model_type", "t2v")
        if model_type not in ORIGINAL_MODEL_TYPES:
            raise ValidationError(
                f"Wan model_type {model_type!r} is not supported; allowed: {', '.join(ORIGINAL_MODEL_TYPES)}"
            )
        window = tuple(raw.get("window_size", (-1, -1)))
        if window != (-1, -1):
            raise ValidationError(f"Wan window_size {list(window)} is not supported; allowed: [-1, -1]")
        if not raw.get("qk_norm", True):
            raise ValidationError("Wan qk_norm=false is not supported; allowed: true")
        unknown = sorted(key for key in raw if not key.startswith("_") and key not in ORIGINAL_FIELDS)
        if unknown:
            raise ValidationError(
                f"unknown original Wan config field(s) {unknown}; known: {', '.join(sorted(ORIGINAL_FIELDS))}"
            )
        try:
            dim, heads = int(raw["dim"]), int(raw["num_heads"])
            image = has_image_embedding and model_type in ("i2v", "flf2v")
            if dim % heads:
                raise ValidationError(f"Wan dim={dim} is not a multiple of num_heads={heads}")
            return WanConfig(
                patch_size=tuple(raw.get("patch_size", (1, 2, 2))),
                num_attention_heads=heads,
                attention_head_dim=dim // heads,
                in_channels=int(raw["in_dim"]),
                out_channels=int(raw["out_dim"]),
                text_dim=int(raw.get("text_dim", 4096)),
                freq_dim=int(raw["freq_dim"]),
                ffn_dim=int(raw["ffn_dim"]),
                num_layers=int(raw["num_layers"]),
                cross_attn_norm=bool(raw.get("cross_attn_norm", True)),
                eps=float(raw["eps"]),
                text_len=int(raw.get("text_len", 512)),
                image_dim=CLIP_IMAGE_DIM if image else None,
                added_kv_proj_dim=dim if image else None,
                pos_embed_seq_len=2 * CLIP_IMAGE_TOKENS if image and model_type == "flf2v" else None,
            )
        except KeyError as err:
            raise ValidationError(f"original Wan config lacks field {err.args[0]!r}") from err


def _require_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValidationError(f"WanConfig.{name} must be a positive int, got {value!r}")


class WanDiT(nn.Module):
    """The Wan text-to-video DiT; state-dict keys equal diffusers' WanTransformer3DModel's."""

    def __init__(self, config: WanConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.dim
        self.patch_embedding = nn.Conv3d(
            config.in_channels, dim, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.condition_embedder = WanConditionEmbedder(
            dim, config.freq_dim, config.text_dim, config.image_dim, config.pos_embed_seq_len
        )
        self.blocks = nn.ModuleList(
            WanBlock(
                dim,
                config.ffn_dim,
                config.num_attention_heads,
                cross_attn_norm=config.cross_attn_norm,
                eps=config.eps,
                added_kv_proj_dim=config.added_kv_proj_dim,
            )
            for _ in range(config.num_layers)
        )
        self.norm_out = FP32LayerNorm(dim, config.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, config.out_channels * math.prod(config.patch_size))
        self.scale_shift_table = scale_shift_table(2, dim)
        self.blocks_compiled = False  # set by compile_blocks()

    @staticmethod
    def keeps_fp32(name: str) -> bool:
        """Whether parameter `name` stays float32 when the model is loaded in bf16/fp16 (as diffusers keeps it)."""
        return not FP32_MODULES.isdisjoint(name.split("."))

    def fuse_projections(self) -> WanDiT:
        """Every block's self-attention q/k/v and cross-attention k/v as one GEMM each; returns self.

        Explicit (off until called) and for inference: the stacked matrices become the storage of
        the checkpoint's parameters (no second copy; state-dict keys and values unchanged; see
        WanAttention.fuse_projections). The wider GEMM may round differently from three narrow
        ones (bf16 rounding, nothing more). compile_blocks() calls it unless told not to.
        """
        for block in self.blocks:
            block.fuse_projections()
        return self

    def set_fused_kernels(self, enabled: bool) -> WanDiT:
        """Turn the Triton row kernels (norms, modulation, residuals, RoPE) on or off in every block; returns self.

        Model setup, not a per-call setting: on by default; they run only on CUDA with Triton
        installed, elsewhere the torch path runs.
        """
        for block in self.blocks:
            block.set_fused_kernels(enabled)
        return self

    def release_fp8_weights(self) -> WanDiT:
        """Drop every block's cached FP8 weight copies; returns self.

        A call with FP8 linears (ExecutionSettings.fp8_layers) quantizes each weight it runs in FP8
        once and keeps the copy (one per layer, re-made only when the weight changes); calls
        without FP8 leave the copies alone. They are bounded by one per FP8-capable layer
        (fp8_linear.fp8_block_bytes per block); the pipeline drops them when a plan moves the
        weights or runs under a memory budget without FP8.
        """
        for block in self.blocks:
            block.release_fp8_weights()
        return self

    def compile_blocks(self, *, fuse: bool = True, **options: Any) -> WanDiT:
        """Regional torch.compile: compile every block in place (options go to torch.compile); returns self.

        Off by default. With fuse (the default) it first calls fuse_projections(). All blocks share
        one code object and dynamo treats parameters as graph inputs, so the block is compiled once
        (on the first forward, seconds to tens of seconds on a GPU) and reused by every layer.
        Metadata, RoPE tables and the attention impl are plain arguments: new values of the same
        kind and shapes do not recompile (a new token count or batch size does, once). Each
        attention call runs eagerly between the compiled regions (see wan_blocks._attend), and the
        Triton row kernels are opaque custom ops, so inductor has little left to fuse (the
        modulation vectors; all the row passes on CPU). Results stay within bf16 rounding of the
        eager path.
        State-dict keys are unchanged. Sets `blocks_compiled`.
        """
        if fuse:
            self.fuse_projections()
        for block in self.blocks:
            block.compile(**options)
        self.blocks_compiled = True
        return self

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (that of the patch embedding)."""
        return self.patch_embedding.weight.dtype

    @staticmethod
    def build_attention_metadata(
        text_lens: torch.Tensor | None = None, *, text_len: int | None = None
    ) -> DiTAttention:
        """Self-attention dense; cross-attention dense (Wan's unmasked padded text) or varlen keys of text_lens [B].

        text_len, when given, is the padded text length the lengths are checked against. Reads the
        lengths on the host once (their max), so build it outside any captured region.
        """
        if text_lens is None:
            return DiTAttention(self_attn=AttentionMetadata(), cross_attn=AttentionMetadata())
        cross = AttentionMetadata.from_lengths(None, text_lens)
        low = int(text_lens.min())
        if low < 1 or (text_len is not None and cross.max_seqlen_k > text_len):
            raise ValidationError(
                f"text_lens must lie in [1, {text_len if text_len is not None else 'L'}], "
                f"got min {low}, max {cross.max_seqlen_k}"
            )
        return DiTAttention(self_attn=AttentionMetadata(), cross_attn=cross)

    def token_grid(self, latents_shape: torch.Size | tuple[int, ...]) -> tuple[int, int, int]:
        """(F', H', W') patches of latents [B, C, F, H, W]; sizes not divisible by the patch raise."""
        sizes = tuple(latents_shape[2:])
        if len(latents_shape) != 5 or any(s % p for s, p in zip(sizes, self.config.patch_size, strict=True)):
            raise ValidationError(
                f"latents of shape {tuple(latents_shape)} do not split into patches {self.config.patch_size}; "
                "expected [B, C, F, H, W] with F, H, W multiples of the patch size"
            )
        return tuple(s // p for s, p in zip(sizes, self.config.patch_size, strict=True))

    def forward(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: torch.Tensor,
        *,
        attention: AttentionImpl,
        text_lens: torch.Tensor | None = None,
        metadata: DiTAttention | None = None,
        parallel: ParallelLayout | None = None,
        settings: ExecutionSettings | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """latents [B, C, F, H, W], timestep [B] float, text [B, L, text_dim] -> [B, C_out, F, H, W] (model dtype).

        The DiT call contract (mmgen.models.call). timestep may be [B, S] (one per token, S = F'*H'*W' patches: Wan2.2 TI2V). image_embeds
        [B, N, image_dim]: image-encoder tokens, required by (and only accepted by) a model with
        an image path; they are attended with metadata.image_cross_attn.
        parallel: a ParallelLayout with sp_degree > 1: every rank of its SP group runs its token shard
        (mmgen.parallel.sequence), per-token timesteps included, and all of them return the whole
        output; None or a single layout runs every token here.
        settings: how this call executes (chunks, FP8 layers and attention, block stream;
        mmgen.models.settings), passed to every block; None = the defaults (whole sequence, no FP8,
        weights where they are).
        """
        call = self.prepare_call(
            latents,
            timestep,
            text,
            attention=attention,
            text_lens=text_lens,
            metadata=metadata,
            parallel=parallel,
            settings=settings,
            image_embeds=image_embeds,
        )
        return self.finish_call(call, self.run_blocks(call))

    def prepare_call(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: torch.Tensor,
        *,
        attention: AttentionImpl,
        text_lens: torch.Tensor | None = None,
        metadata: DiTAttention | None = None,
        parallel: ParallelLayout | None = None,
        settings: ExecutionSettings | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> WanCall:
        """The top of forward (arguments as forward's): inputs checked and embedded once, as a WanCall.

        A variant with a stream of its own (VACE's control blocks) reads the call's embedded text,
        timestep projection, RoPE tables and metadata from it rather than making them again.
        """
        settings = ExecutionSettings() if settings is None else settings
        if settings.fp8_layers:
            check_fp8_device(latents.device, self.dtype)
        grid = self.token_grid(latents.shape)
        self._check_inputs(latents, timestep, text, math.prod(grid), image_embeds)
        rope = rope_3d_tables(
            grid,
            self.config.attention_head_dim,
            device=latents.device,
            max_positions=self.config.rope_max_seq_len,
        )
        if metadata is None:
            metadata = self.build_attention_metadata(
                None if text_lens is None else text_lens.to(text.device), text_len=text.shape[1]
            )
        x = embed_patches(self.patch_embedding, latents.to(self.dtype))
        sharded = parallel is not None and parallel.sp_degree > 1
        if sharded and timestep.dim() == 2:
            # Per-token timesteps (Wan2.2 TI2V) are split like the tokens (the same plan as
            # shard_dit_inputs'): each rank embeds and modulates only its own tokens.
            timestep = SequenceShard.plan(timestep.shape[1], parallel).split(timestep)
        token_rows = None
        if timestep.dim() == 2:
            # Per token, the timesteps take a few values (TI2V: the conditioning frame's 0 and t):
            # embed those alone; each token reads its row of the tables through token_rows [B, S].
            timestep, token_rows = distinct_timesteps(timestep)
        temb, time_projection, text = self.condition_embedder(timestep, text.to(self.dtype))
        time_projection = time_projection.unflatten(-1, (6, -1))  # [N, 6, dim]: N = B, or distinct timesteps
        image = None
        if image_embeds is not None:
            image = self.condition_embedder.image_embedder(image_embeds.to(self.dtype))
        shard = None
        if sharded:
            shard, x, rope, metadata, attention = shard_dit_inputs(
                parallel, self.config.num_attention_heads, x, rope, metadata, attention
            )
        return WanCall(
            attention=attention,
            metadata=metadata,
            rope=rope,
            temb=temb,
            settings=settings,
            x=x,
            text=text,
            time_projection=time_projection,
            grid=grid,
            image=image,
            token_rows=token_rows,
            shard=shard,
        )

    def run_blocks(
        self, call: WanCall, hints: Iterator[tuple[int, torch.Tensor]] | None = None
    ) -> torch.Tensor:
        """The transformer blocks over call.x -> tokens [B, S, dim].

        hints: residuals added to the stream after chosen blocks, (block index, [B, S, dim]) in
        increasing block order (VACE's control hints); each is drawn only once the one before it
        is added, so a producer may compute them lazily. None = no residuals (the plain model).
        """
        x = call.x
        pending = None if hints is None else next(hints, None)
        for index, block in enumerate(call.settings.blocks(self.blocks)):
            x = block(x, call)
            if pending is not None and pending[0] == index:
                x = x + pending[1]
                pending = next(hints, None)
        if pending is not None:
            raise ValidationError(
                f"a hint for block {pending[0]} was never added (blocks: {len(self.blocks)})"
            )
        return x

    def finish_call(self, call: WanCall, x: torch.Tensor) -> torch.Tensor:
        """The output head over the blocks' tokens x [B, S, dim] -> [B, C_out, F, H, W].

        Under sequence parallel each rank normalizes its own tokens, and the projection runs on the
        whole gathered sequence, on every rank, as one process's does: cuBLAS picks a GEMM's kernel by
        its row count, and for this 64-column projection over a shard's rows it picked a split-K kernel
        (another order of the sums) where the whole sequence's call did not: Wan2.1-14B at 480x832x5
        made other frames on 4 GPUs than on one (benchmarks/gemm_rows.py, RESULTS.md 27). The gather
        moves dim columns instead of out_channels x patch (+1.5-5 ms a step at 720p on 4 GPUs; Qwen-Image-2.1
        gathers before its head too); its memory (the gathered parts and their concatenation, ~2 x one
        [B, S, dim]) is below the blocks' peak that memory plans budget (one process's whole sequence).
        """
        chunk = call.settings.block_chunk
        # temb [N, dim]: one vector for both rows of the table. The torch path (as before the row
        # kernels): once per call, and it keeps the output bits of the per-sample models.
        shift, scale = modulation_vectors(self.scale_shift_table, call.temb.unsqueeze(-2), 2)

        def normed(rows: slice) -> torch.Tensor:  # x[:, rows] [B, S', dim], normalized and modulated
            token_rows = None if call.token_rows is None else call.token_rows[:, rows]
            return layer_norm_modulate(
                x[:, rows],
                eps=self.norm_out.eps,
                shift=shift,
                scale=scale,
                kernel=False,
                token_rows=token_rows,
            )

        if call.shard is None:
            out = _by_rows(x, chunk, self.proj_out.out_features, lambda rows: self.proj_out(normed(rows)))
        else:
            whole = call.shard.gather(_by_rows(x, chunk, x.shape[-1], normed))
            out = _by_rows(
                whole, chunk, self.proj_out.out_features, lambda rows: self.proj_out(whole[:, rows])
            )
        return unpatchify(out, call.grid, self.config.patch_size, self.config.out_channels)

    def _check_inputs(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: torch.Tensor,
        tokens: int,
        image_embeds: torch.Tensor | None,
    ) -> None:
        batch = latents.shape[0]
        if latents.dim() != 5 or latents.shape[1] != self.config.in_channels:
            raise ValidationError(
                f"latents must be [B, {self.config.in_channels}, F, H, W], got {tuple(latents.shape)}"
            )
        if tuple(timestep.shape) not in ((batch,), (batch, tokens)):
            raise ValidationError(
                f"timestep must have shape ({batch},) (one per sample) or ({batch}, {tokens}) (one per token), "
                f"got {tuple(timestep.shape)}"
            )
        if text.dim() != 3 or text.shape[0] != batch or text.shape[2] != self.config.text_dim:
            raise ValidationError(
                f"text must be [{batch}, L, {self.config.text_dim}], got {tuple(text.shape)}"
            )
        image_dim = self.config.image_dim
        if image_dim is None and image_embeds is not None:
            raise ValidationError(
                "image_embeds given, but this model has no image path (config image_dim null)"
            )
        if image_dim is None:
            return
        # FLF2V (pos_embed_seq_len): the first and last frame, [2 * B, N, image_dim], N = seq_len / 2.
        images = 1 if self.config.pos_embed_seq_len is None else 2
        if (
            image_embeds is None
            or image_embeds.dim() != 3
            or image_embeds.shape[0] != images * batch
            or image_embeds.shape[2] != image_dim
            or (images == 2 and 2 * image_embeds.shape[1] != self.config.pos_embed_seq_len)
        ):
            got = None if image_embeds is None else tuple(image_embeds.shape)
            tokens_needed = "N" if images == 1 else self.config.pos_embed_seq_len // 2
            raise ValidationError(
                f"image_embeds must be [{images * batch}, {tokens_needed}, {image_dim}] for this model, got {got}"
            )


def _by_rows(
    x: torch.Tensor, chunk: int | None, columns: int, head: Callable[[slice], torch.Tensor]
) -> torch.Tensor:
    """head(rows) [B, S', columns] over x's tokens x [B, S, ...]: one call, or under a memory plan's block
    chunks (chunk) one per range of `chunk` tokens, written into one output (the head's float32 norm
    temporaries over the whole sequence would otherwise be the forward's peak). The ranges are the same
    whether x is one process's tokens or a gathered sequence's, so are the projection's calls."""
    if chunk is None or x.shape[1] <= chunk:
        return head(slice(None))
    out = x.new_empty(*x.shape[:2], columns)
    for start in range(0, x.shape[1], chunk):
        out[:, start : start + chunk] = head(slice(start, start + chunk))
    return out


def embed_patches(patch_embedding: nn.Conv3d, latents: torch.Tensor) -> torch.Tensor:
    """latents [B, C, F, H, W] -> tokens [B, S, dim] through a patch embedding.

    Convolution kernels round a batch of one unlike each sample of a batch of two (seen on CPU):
    a lone sample runs as two equal ones (one small convolution more), so a sequential-CFG
    call gets exactly the bits of the batch-2 CFG call it replaces.
    """
    if latents.shape[0] != 1:
        return patch_tokens(patch_embedding, latents)

    def first_of_two(z: torch.Tensor) -> torch.Tensor:  # only the kept sample is transposed
        return patch_embedding(z.expand(2, *z.shape[1:]))[:1]

    return patch_tokens(first_of_two, latents)
