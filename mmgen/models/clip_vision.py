"""The CLIP vision tower as Wan2.1 I2V uses it: pixels -> the penultimate layer's hidden states.

diffusers' WanImageToVideoPipeline runs transformers' CLIPVisionModel with output_hidden_states and
keeps hidden_states[-2]: the output of the second-to-last encoder layer, before any final norm. So
this module runs the embeddings, the pre-norm and all layers but the last; the last layer and the
post-norm are loaded (the checkpoint has them) but never run.

Parameter names are transformers' CLIPVisionModel's (without its older `vision_model.` prefix).
Also here: the CLIP image preprocessing (CLIPImageProcessor's resize, center crop, rescale and
normalize) read from a checkpoint's image_processor/preprocessor_config.json.

Shapes: pixels [B, 3, S, S] (S = image_size) -> tokens [B, 1 + (S / patch)^2, hidden_size].
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from mmgen.errors import ValidationError

ACTIVATIONS = ("gelu", "quick_gelu")
# CLIPImageProcessor's resampling codes (PIL's): 2 bilinear, 3 bicubic.
RESAMPLE_CODES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ClipVisionConfig:
    """The fields of a transformers CLIPVisionConfig this module uses (names and defaults are its)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValidationError(f"CLIP vision config {f.name} must be a positive int, got {value!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValidationError(
                f"CLIP vision config hidden_act {self.hidden_act!r} is not supported; allowed: "
                f"{', '.join(ACTIVATIONS)}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValidationError(
                f"CLIP vision hidden_size {self.hidden_size} is not a multiple of "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.image_size % self.patch_size:
            raise ValidationError(
                f"CLIP vision image_size {self.image_size} is not a multiple of patch_size {self.patch_size}"
            )
        if self.num_hidden_layers < 2:
            raise ValidationError("CLIP vision needs >= 2 layers (Wan reads the penultimate layer's output)")

    @staticmethod
    def from_hf_config(raw: dict[str, Any]) -> ClipVisionConfig:
        """From a transformers config.json dict (a CLIPModel's vision_config is read when present)."""
        raw = raw.get("vision_config", raw)
        known = {f.name for f in fields(ClipVisionConfig)}
        return ClipVisionConfig(**{key: value for key, value in raw.items() if key in known})

    @staticmethod
    def open_clip_vit_h_14() -> ClipVisionConfig:
        """Wan2.1 I2V's image encoder (open-clip ViT-H/14, 257 tokens of width 1280)."""
        return ClipVisionConfig(
            hidden_size=1280,
            intermediate_size=5120,
            num_hidden_layers=32,
            num_attention_heads=16,
            patch_size=14,
            hidden_act="gelu",
        )


class ClipVisionEmbeddings(nn.Module):
    """Pixels [B, 3, S, S] -> [class token, patch tokens] + learned positions, [B, 1 + P, hidden]."""

    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.class_embedding = nn.Parameter(torch.zeros(dim))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, dim, kernel_size=config.patch_size, stride=config.patch_size, bias=False
        )
        positions = (config.image_size // config.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(positions, dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = (
            self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        )
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipAttention(nn.Module):
    """Dense bidirectional multi-head self-attention (scale head_dim^-0.5) over the image tokens."""

    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.heads = config.num_attention_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, N, dim] -> [B, H, N, head_dim]
            return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        )
        return self.out_proj(out.transpose(1, 2).flatten(2))


class ClipMLP(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.quick = config.hidden_act == "quick_gelu"
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = h * torch.sigmoid(1.702 * h) if self.quick else F.gelu(h)
        return self.fc2(h)


class ClipEncoderLayer(nn.Module):
    """Pre-norm transformer layer: x + attn(LN(x)), then x + mlp(LN(x))."""

    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.self_attn = ClipAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = ClipMLP(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ClipEncoderLayer(config) for _ in range(config.num_hidden_layers))


class ClipVisionEncoder(nn.Module):
    """CLIP vision tower returning the penultimate layer's hidden states (what Wan2.1 I2V attends to)."""

    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = ClipVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(
            config.hidden_size, eps=config.layer_norm_eps
        )  # transformers' spelling
        self.encoder = _Encoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.patch_embedding.weight.dtype

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 3, S, S] (normalized) -> penultimate hidden states [B, 1 + (S / patch)^2, hidden]."""
        size = self.config.image_size
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (self.config.num_channels, size, size):
            raise ValidationError(
                f"CLIP pixels must be [B, {self.config.num_channels}, {size}, {size}], got {tuple(pixels.shape)}"
            )
        x = self.pre_layrnorm(self.embeddings(pixels))
        for layer in self.encoder.layers[:-1]:
            x = layer(x)
        return x


@dataclass(frozen=True)
class ClipImagePreprocess:
    """CLIPImageProcessor's steps for one RGB image: shortest edge -> `shortest_edge` (PIL, `resample`),
    center crop to `crop_size`, x / 255, (x - mean) / std. Defaults are CLIP's (and Wan2.1 I2V's)."""

    shortest_edge: int = 224
    crop_height: int = 224
    crop_width: int = 224
    resample: str = "bicubic"
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD

    @staticmethod
    def from_config(raw: dict[str, Any]) -> ClipImagePreprocess:
        """From preprocessor_config.json; switches this implementation does not follow raise."""
        for flag in ("do_resize", "do_center_crop", "do_rescale", "do_normalize"):
            if raw.get(flag, True) is not True:
                raise ValidationError(f"image processor {flag}={raw[flag]!r} is not supported; allowed: true")
        size = raw.get("size", {"shortest_edge": 224})
        crop = raw.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        if not isinstance(size, dict) or set(size) != {"shortest_edge"}:
            raise ValidationError(
                f"image processor size {size!r} is not supported; allowed: {{'shortest_edge': N}}"
            )
        resample = raw.get("resample", 3)
        if resample not in RESAMPLE_CODES:
            raise ValidationError(f"image processor resample {resample!r}: allowed {sorted(RESAMPLE_CODES)}")
        return ClipImagePreprocess(
            shortest_edge=int(size["shortest_edge"]),
            crop_height=int(crop["height"]),
            crop_width=int(crop["width"]),
            resample=RESAMPLE_CODES[resample],
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
            image_mean=tuple(raw.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=tuple(raw.get("image_std", OPENAI_CLIP_STD)),
        )

    def __call__(self, image: Any) -> torch.Tensor:
        """An RGB PIL image -> float32 pixels [1, 3, crop_height, crop_width]."""
        width, height = image.size
        short, long = min(width, height), max(width, height)
        # transformers' rule: the long side is int(edge * long / short) (truncated, not rounded).
        new_long = int(self.shortest_edge * long / short)
        size = (self.shortest_edge, new_long) if width <= height else (new_long, self.shortest_edge)
        resized = image.resize(size, resample=getattr(Image.Resampling, self.resample.upper()))
        array = np.asarray(resized, dtype=np.uint8)
        top = (array.shape[0] - self.crop_height) // 2
        left = (array.shape[1] - self.crop_width) // 2
        if top < 0 or left < 0:
            raise ValidationError(
                f"image resized to {array.shape[1]}x{array.shape[0]} is smaller than the CLIP crop "
                f"{self.crop_width}x{self.crop_height}"
            )
        array = array[top : top + self.crop_height, left : left + self.crop_width]
        pixels = array.astype(np.float32) * np.float32(self.rescale_factor)
        mean = np.asarray(self.image_mean, dtype=np.float32)
        std = np.asarray(self.image_std, dtype=np.float32)
        pixels = (pixels - mean) / std
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))[None]
