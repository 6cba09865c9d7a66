"""The UMT5 text encoder: T5 layers with a relative position bias table in every layer.

Parameter names follow transformers' `UMT5EncoderModel` checkpoints (`shared.weight`,
`encoder.block.{i}.layer.0.SelfAttention.q.weight`, ...), so a `save_pretrained` directory loads as is.
The padding is explicit metadata (`TextPadding`): the encoder turns it into one additive key mask at
the top of `forward` and hands that mask, with the shared relative position buckets, to every layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mmgen.errors import ValidationError
from mmgen.layers.meta_init import embedding

# Activation names as transformers' config files spell them (`dense_act_fn`); read-only.
ACTIVATIONS = MappingProxyType(
    {
        "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu": F.gelu,
        "relu": F.relu,
        "silu": F.silu,
        "swish": F.silu,
    }
)


def _activation_of(feed_forward_proj: str) -> tuple[str, bool]:
    """(dense_act_fn, is_gated_act) as transformers derives them from `feed_forward_proj`."""
    parts = feed_forward_proj.split("-") if isinstance(feed_forward_proj, str) else []
    if not parts or len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise ValidationError(
            f"UMT5 config: feed_forward_proj {feed_forward_proj!r} is not of the form 'gated-ACT' or 'ACT'"
        )
    # T5's "gated-gelu" means the tanh approximation, a historical quirk transformers keeps.
    act = "gelu_new" if feed_forward_proj == "gated-gelu" else parts[-1]
    return act, len(parts) == 2


@dataclass(frozen=True)
class UMT5Config:
    """Shape and numerics of a UMT5 encoder; field names are those of transformers' config.json."""

    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_heads: int
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "gated-gelu"
    dense_act_fn: str = "gelu_new"
    is_gated_act: bool = True
    pad_token_id: int = 0
    eos_token_id: int = 1

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValidationError(f"UMT5 config: {name} = {value!r}, must be a positive integer")
        buckets = self.relative_attention_num_buckets
        if not isinstance(buckets, int) or buckets < 4:
            raise ValidationError(
                f"UMT5 config: relative_attention_num_buckets = {buckets!r}, must be an integer >= 4"
            )
        # Half the (per-direction) buckets are exact offsets; the log-spaced rest needs max_distance beyond them.
        max_exact = buckets // 4
        if not isinstance(self.relative_attention_max_distance, int) or (
            self.relative_attention_max_distance <= max_exact
        ):
            raise ValidationError(
                f"UMT5 config: relative_attention_max_distance = {self.relative_attention_max_distance!r}, "
                f"must be an integer > {max_exact} for {buckets} buckets"
            )
        if not self.layer_norm_epsilon > 0:
            raise ValidationError(
                f"UMT5 config: layer_norm_epsilon = {self.layer_norm_epsilon!r}, must be > 0"
            )
        if self.dense_act_fn not in ACTIVATIONS:
            raise ValidationError(
                f"UMT5 config: dense_act_fn {self.dense_act_fn!r} is not supported; "
                f"allowed: {', '.join(sorted(ACTIVATIONS))}"
            )

    @property
    def inner_dim(self) -> int:
        """Width of the concatenated attention heads (num_heads * d_kv)."""
        return self.num_heads * self.d_kv

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> UMT5Config:
        """Build from a transformers UMT5 config.json dict; shape fields are required, the rest default as in HF."""
        missing = [
            name
            for name in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads")
            if name not in hf
        ]
        if missing:
            raise ValidationError(f"UMT5 config: missing field(s) {', '.join(missing)}")
        feed_forward_proj = hf.get("feed_forward_proj", "gated-gelu")
        act, gated = _activation_of(feed_forward_proj)
        eps = hf.get("layer_norm_epsilon", 1e-6)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise ValidationError(f"UMT5 config: layer_norm_epsilon = {eps!r}, must be a number > 0")
        # transformers lets explicit dense_act_fn / is_gated_act in the file override the derived values.
        return cls(
            vocab_size=hf["vocab_size"],
            d_model=hf["d_model"],
            d_kv=hf["d_kv"],
            d_ff=hf["d_ff"],
            num_layers=hf["num_layers"],
            num_heads=hf["num_heads"],
            relative_attention_num_buckets=hf.get("relative_attention_num_buckets", 32),
            relative_attention_max_distance=hf.get("relative_attention_max_distance", 128),
            layer_norm_epsilon=float(eps),
            feed_forward_proj=feed_forward_proj,
            dense_act_fn=hf.get("dense_act_fn", act),
            is_gated_act=bool(hf.get("is_gated_act", gated)),
            pad_token_id=hf.get("pad_token_id", 0),
            eos_token_id=hf.get("eos_token_id", 1),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict that transformers' UMT5Config / UMT5EncoderModel read back to this model."""
        return {
            "architectures": ["UMT5EncoderModel"],
            "model_type": "umt5",
            "vocab_size": self.vocab_size,
            "d_model": self.d_model,
            "d_kv": self.d_kv,
            "d_ff": self.d_ff,
            "num_layers": self.num_layers,
            "num_decoder_layers": self.num_layers,
            "num_heads": self.num_heads,
            "relative_attention_num_buckets": self.relative_attention_num_buckets,
            "relative_attention_max_distance": self.relative_attention_max_distance,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "feed_forward_proj": self.feed_forward_proj,
            "dense_act_fn": self.dense_act_fn,
            "is_gated_act": self.is_gated_act,
            "dropout_rate": 0.0,
            "initializer_factor": 1.0,
            "is_encoder_decoder": True,
            "tie_word_embeddings": True,
            "use_cache": False,
            "pad_token_id": self.pad_token_id,
            "eos_token_id": self.eos_token_id,
            "decoder_start_token_id": self.pad_token_id,
        }


@dataclass(frozen=True, eq=False)
class TextPadding:
    """Right padding of a token batch as explicit metadata: `lengths` int64 [B] valid tokens per row."""

    lengths: torch.Tensor

    def __post_init__(self) -> None:
        if self.lengths.dim() != 1 or self.lengths.is_floating_point() or self.lengths.is_complex():
            raise ValidationError(
                f"TextPadding.lengths must be a 1-D integer tensor, got {self.lengths.dtype} "
                f"of shape {tuple(self.lengths.shape)}"
            )

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> TextPadding:
        """From an attention mask [B, L] (1 = token, 0 = pad) that must be right-padded."""
        if mask.dim() != 2:
            raise ValidationError(f"attention mask must be [batch, length], got shape {tuple(mask.shape)}")
        lengths = (mask != 0).sum(dim=1).to(torch.int64)
        padding = cls(lengths)
        # Only right padding can be expressed as lengths; anything else would be silently misread.
        if not torch.equal(mask != 0, padding.valid_mask(mask.shape[1]).to(mask.device)):
            raise ValidationError("attention mask is not right-padded (ones then zeros in every row)")
        return padding

    @classmethod
    def full(cls, batch: int, length: int, device: str | torch.device = "cpu") -> TextPadding:
        """No padding: every one of the `length` tokens in each of the `batch` rows is valid."""
        return cls(torch.full((batch,), length, dtype=torch.int64, device=device))

    def valid_mask(self, length: int) -> torch.Tensor:
        """Boolean [B, length]: True where a position holds a real token."""
        positions = torch.arange(length, device=self.lengths.device)
        return positions[None, :] < self.lengths[:, None]

    def additive_key_mask(self, length: int, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
        """[B, 1, 1, length] of `dtype`: 0 on real keys, the dtype's lowest value on padded keys."""
        valid = self.valid_mask(length).to(device)
        mask = torch.zeros(valid.shape, dtype=dtype, device=device)
        mask.masked_fill_(~valid, torch.finfo(dtype).min)
        return mask[:, None, None, :]


def relative_position_buckets(
    length: int, num_buckets: int, max_distance: int, device: str | torch.device
) -> torch.Tensor:
    """Bidirectional T5 buckets of (key - query) offsets: int64 [length, length] in [0, num_buckets)."""
    positions = torch.arange(length, dtype=torch.int64, device=device)
    offset = positions[None, :] - positions[:, None]
    half = num_buckets // 2
    # One half of the buckets for keys after the query, the other for keys before it (or at it).
    direction = (offset > 0).to(torch.int64) * half
    distance = offset.abs()
    max_exact = half // 2
    # Distances below max_exact get a bucket each; farther ones share log-spaced buckets up to max_distance.
    # The clamp keeps log() finite on the small distances whose value torch.where discards anyway.
    far = torch.log(distance.clamp(min=max_exact).float() / max_exact) / math.log(max_distance / max_exact)
    far = max_exact + (far * (half - max_exact)).to(torch.int64)
    far = far.clamp(max=half - 1)
    return direction + torch.where(distance < max_exact, distance, far)


def _clamp_fp16(hidden: torch.Tensor) -> torch.Tensor:
    """Keep fp16 activations finite the way transformers' T5 blocks do; other dtypes pass through."""
    if hidden.dtype != torch.float16:
        return hidden
    top = torch.finfo(torch.float16).max
    limit = torch.where(torch.isinf(hidden).any(), top - 1000, top)
    return torch.clamp(hidden, min=-limit, max=limit)


class T5RMSNorm(nn.Module):
    """T5 layer norm: scale only, mean of squares taken in fp32, result cast back for half weights."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> [..., dim] in the weight's dtype when that is half precision."""
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


class UMT5SelfAttention(nn.Module):
    """Multi-head self-attention with this layer's own relative position bias and no 1/sqrt(d) scaling."""

    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.d_kv
        self.q = nn.Linear(config.d_model, config.inner_dim, bias=False)
        self.k = nn.Linear(config.d_model, config.inner_dim, bias=False)
        self.v = nn.Linear(config.d_model, config.inner_dim, bias=False)
        self.o = nn.Linear(config.inner_dim, config.d_model, bias=False)
        self.relative_attention_bias = embedding(config.relative_attention_num_buckets, config.num_heads)

    def forward(self, x: torch.Tensor, buckets: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x [B, L, d_model], buckets int64 [L, L], key_mask [B, 1, 1, L] additive -> [B, L, d_model]."""
        batch, length, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        position_bias = self.relative_attention_bias(buckets).permute(2, 0, 1)[None]  # [1, H, L, L]
        scores_bias = position_bias + key_mask.to(position_bias.dtype)
        # T5 folds the 1/sqrt(d) factor into the initialization of q, so the kernel must not scale.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=scores_bias.to(q.dtype), scale=1.0)
        return self.o(out.transpose(1, 2).reshape(batch, length, -1))


class UMT5FeedForward(nn.Module):
    """T5 feed-forward: act(wi_0 x) * wi_1 x (gated) or act(wi x), then wo."""

    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        self.gated = config.is_gated_act
        if self.gated:
            self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
            self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        else:
            self.wi = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.act = ACTIVATIONS[config.dense_act_fn]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, d_model] -> [B, L, d_model] in wo's dtype (kept fp32 for fp16 models, as in HF)."""
        if self.gated:
            h = self.act(self.wi_0(x)) * self.wi_1(x)
        else:
            h = self.act(self.wi(x))
        return self.wo(h.to(self.wo.weight.dtype))


class UMT5AttentionSublayer(nn.Module):
    """Pre-norm residual around self-attention (checkpoint path `layer.0`)."""

    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        self.SelfAttention = UMT5SelfAttention(config)
        self.layer_norm = T5RMSNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor, buckets: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x [B, L, d_model] -> [B, L, d_model]."""
        return x + self.SelfAttention(self.layer_norm(x), buckets, key_mask)


class UMT5FeedForwardSublayer(nn.Module):
    """Pre-norm residual around the feed-forward (checkpoint path `layer.1`)."""

    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        self.DenseReluDense = UMT5FeedForward(config)
        self.layer_norm = T5RMSNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, d_model] -> [B, L, d_model]."""
        return x + self.DenseReluDense(self.layer_norm(x))


class UMT5Block(nn.Module):
    """One encoder layer: attention then feed-forward, each with the fp16 overflow clamp."""

    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        self.layer = nn.ModuleList([UMT5AttentionSublayer(config), UMT5FeedForwardSublayer(config)])

    def forward(self, x: torch.Tensor, buckets: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x [B, L, d_model] -> [B, L, d_model]."""
        x = _clamp_fp16(self.layer[0](x, buckets, key_mask))
        return _clamp_fp16(self.layer[1](x))


class UMT5Stack(nn.Module):
    """The encoder layers and the final norm (checkpoint prefix `encoder.`)."""

    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        self.block = nn.ModuleList([UMT5Block(config) for _ in range(config.num_layers)])
        self.final_layer_norm = T5RMSNorm(config.d_model, config.layer_norm_epsilon)

    def forward(
        self,
        x: torch.Tensor,
        buckets: torch.Tensor,
        key_mask: torch.Tensor,
        block_stream: Callable[[nn.ModuleList], Iterable[nn.Module]] | None = None,
    ) -> torch.Tensor:
        """x [B, L, d_model] embeddings -> [B, L, d_model] hidden states.

        block_stream: a layer-offload placement's mmgen.placement.BlockStream (each layer bound to
        device copies of its weights while it runs), passed per call; None = the weights stay put.
        """
        for block in self.block if block_stream is None else block_stream(self.block):
            x = block(x, buckets, key_mask)
        return self.final_layer_norm(x)


class UMT5Encoder(nn.Module):
    """UMT5 encoder with transformers' `UMT5EncoderModel` parameter names.

    The token embedding lives at `shared.weight` only; checkpoints that also store the tied alias
    `encoder.embed_tokens.weight` are mapped by the loader.
    """

    def __init__(self, config: UMT5Config) -> None:
        super().__init__()
        self.config = config
        self.shared = embedding(config.vocab_size, config.d_model)
        self.encoder = UMT5Stack(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        padding: TextPadding | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        block_stream: Callable[[nn.ModuleList], Iterable[nn.Module]] | None = None,
    ) -> torch.Tensor:
        """input_ids int64 [B, L] and padding (or a right-padded attention_mask [B, L]) -> [B, L, d_model].

        With neither, every token is valid. Padded positions still get hidden states (they attend to
        the real tokens), exactly as in transformers. block_stream: as UMT5Stack.forward's.
        """
        if input_ids.dim() != 2:
            raise ValidationError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
        batch, length = input_ids.shape
        if padding is not None and attention_mask is not None:
            raise ValidationError("pass either padding or attention_mask to the UMT5 encoder, not both")
        if attention_mask is not None:
            padding = TextPadding.from_mask(attention_mask)
        if padding is None:
            padding = TextPadding.full(batch, length, device=input_ids.device)
        if padding.lengths.shape[0] != batch:
            raise ValidationError(f"padding has {padding.lengths.shape[0]} rows, input_ids has {batch}")
        x = self.shared(input_ids)
        # Built once per call and shared by every layer: each layer only looks up its own bias table.
        key_mask = padding.additive_key_mask(length, x.dtype, x.device)
        buckets = relative_position_buckets(
            length,
            self.config.relative_attention_num_buckets,
            self.config.relative_attention_max_distance,
            x.device,
        )
        return self.encoder(x, buckets, key_mask, block_stream)


def launch_first_kernels(device: torch.device, dtype: torch.dtype, head_dim: int = 64) -> None:
    """Launch once, on CUDA `device` in `dtype`, the kernels a UMT5 encoder's first call launches; the
    results are dropped.

    CUDA loads a kernel at its first launch. A real encoder's first call in a fresh process (UMT5-XXL, 512
    tokens, an H200) paid such loads for its padding mask, its position buckets and its attention with a
    bias (benchmarks/RESULTS.md 31). Here a one-layer, one-head encoder of the real head width (the
    attention kernel is chosen by it) runs on a right-padded batch of two 16-token rows, as encode_text
    hands the real one. Its weights are constants (no random generator is drawn from: this runs beside
    the load, in mmgen.layers.kernel_set_up's thread). The matmuls' shapes are not the real ones: their
    libraries are set up there too.
    """
    config = UMT5Config(
        vocab_size=8, d_model=head_dim, d_kv=head_dim, d_ff=head_dim, num_layers=1, num_heads=1
    )
    with torch.device("meta"):
        encoder = UMT5Encoder(config)
    # Constants assigned in place of the meta parameters: Module.to_empty from meta onto a GPU imports
    # sympy (torch's reference ops), ~0.3 s holding the GIL the load's readers need.
    weights = {
        name: torch.full(p.shape, 1.0 / head_dim, dtype=dtype, device=device)
        for name, p in encoder.state_dict().items()
    }
    encoder.load_state_dict(weights, assign=True)
    with torch.no_grad():
        mask = torch.ones(2, 16, dtype=torch.int64, device=device)
        mask[1, 5:] = 0
        encoder(torch.ones(2, 16, dtype=torch.int64, device=device), attention_mask=mask)
