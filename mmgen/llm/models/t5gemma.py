"""The T5Gemma encoder-decoder (Gemma-2-style stacks) on the paged-KV runtime.

Parameter names equal HF `T5GemmaForConditionalGeneration` state_dict keys, so HF checkpoints load
as they are. Facts matched to transformers' modeling_t5gemma:
- embeddings scaled by sqrt(hidden_size) (the factor cast to the activation dtype first);
- RMSNorm with a (1 + weight) gain before and after attention, cross-attention and MLP;
- attention scale query_pre_attn_scalar ** -0.5; tanh logit softcap on self- and cross-attention;
- encoder sliding layers are bidirectional: key j visible to query i iff |i - j| <= sliding_window;
  decoder sliding layers are causal: j in (i - sliding_window, i], i.e. sliding_window keys;
- cross-attention: no RoPE, no window, softcapped, keys = the final (normed) encoder output;
- logits = lm_head (tied to the decoder embeddings unless tie_word_embeddings is false), then
  the final softcap.

Token layout: every tensor is packed over the batch ([num_tokens, ...]), never padded.
The encoder runs its bidirectional attention through a varlen function with flash-attn's
`flash_attn_varlen_func` signature over packed prompts (no KV cache: its keys never outlive the
call); by default the pure-torch reference from mmgen.kernels, a real FA kernel can be passed in.
The decoder runs every attention through an AttentionBackend over the paged KV pools.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mmgen.errors import ValidationError
from mmgen.kernels.flash_attn import flash_attn_varlen_func
from mmgen.llm.attention_layer import AttentionLayer
from mmgen.llm.backends.base import AttentionBackend
from mmgen.llm.forward_batch import ForwardBatch
from mmgen.llm.models.t5gemma_layers import ACTIVATIONS, GatedMLP, RMSNorm, apply_rope, rope_cos_sin

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class T5GemmaStackConfig:
    """One stack (encoder or decoder) of T5Gemma; field names follow HF's T5GemmaModuleConfig."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    hidden_activation: str = "gelu_pytorch_tanh"
    attention_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) < 1:
                raise ValidationError(f"T5Gemma config: {name}={getattr(self, name)} must be >= 1")
        if self.num_attention_heads < 1 or self.num_key_value_heads < 1:
            raise ValidationError("T5Gemma config: num_attention_heads and num_key_value_heads must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValidationError(
                f"T5Gemma config: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValidationError(
                f"T5Gemma config: {len(self.layer_types)} layer_types for num_hidden_layers={self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValidationError(
                f"T5Gemma config: layer_types {bad} not supported; allowed: {', '.join(LAYER_TYPES)}"
            )
        if "sliding_attention" in self.layer_types and (
            self.sliding_window is None or self.sliding_window < 1
        ):
            raise ValidationError(
                f"T5Gemma config: sliding_attention layers need sliding_window >= 1, got {self.sliding_window}"
            )
        if self.hidden_activation not in ACTIVATIONS:
            raise ValidationError(
                f"T5Gemma config: hidden_activation={self.hidden_activation!r} not supported; "
                f"allowed: {', '.join(ACTIVATIONS)}"
            )

    def window_of(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    @property
    def scaling(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5

    @property
    def attn_softcap(self) -> float:
        return float(self.attn_logit_softcapping or 0.0)


@dataclass(frozen=True)
class T5GemmaConfig:
    """The encoder-decoder: its two stacks and the generation token ids."""

    encoder: T5GemmaStackConfig
    decoder: T5GemmaStackConfig
    tie_word_embeddings: bool = True
    decoder_start_token_id: int = 2
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int = 0


def _linear_heads(x: torch.Tensor, proj: nn.Linear, head_dim: int) -> torch.Tensor:
    return proj(x).view(x.shape[0], -1, head_dim)


class EncoderSelfAttention(nn.Module):
    """Bidirectional self-attention over packed prompts (varlen, no cache)."""

    def __init__(self, cfg: T5GemmaStackConfig, layer_idx: int):
        super().__init__()
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.head_dim = d
        self.scaling = cfg.scaling
        self.softcap = cfg.attn_softcap
        self.window = cfg.window_of(layer_idx)
        self.q_proj = nn.Linear(cfg.hidden_size, heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(heads * d, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen: int, varlen_attention: Callable) -> torch.Tensor:
        """x [N, hidden], cos/sin [N, D], cu_seqlens int32 [B + 1] -> [N, hidden]."""
        q = apply_rope(_linear_heads(x, self.q_proj, self.head_dim), cos, sin)
        k = apply_rope(_linear_heads(x, self.k_proj, self.head_dim), cos, sin)
        v = _linear_heads(x, self.v_proj, self.head_dim)
        # HF's bidirectional sliding mask keeps |i - j| <= window: `window` keys on each side.
        window = (self.window, self.window) if self.window is not None else (-1, -1)
        out = varlen_attention(
            q,
            k,
            v,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
            softmax_scale=self.scaling,
            causal=False,
            window_size=window,
            softcap=self.softcap,
        )
        return self.o_proj(out.reshape(x.shape[0], -1))


class DecoderSelfAttention(nn.Module):
    """Causal self-attention through the backend over the decoder slots of each request."""

    def __init__(self, cfg: T5GemmaStackConfig, layer_idx: int):
        super().__init__()
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.head_dim = d
        self.attn = AttentionLayer(
            layer_id=layer_idx,
            num_q_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=d,
            scaling=cfg.scaling,
            sliding_window=cfg.window_of(layer_idx),
            logit_softcap=cfg.attn_softcap,
            is_cross_attention=False,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(heads * d, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x, cos, sin, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """x [T, hidden], cos/sin [T, D] -> [T, hidden]; writes this step's K/V at batch.out_cache_loc."""
        q = apply_rope(_linear_heads(x, self.q_proj, self.head_dim), cos, sin)
        k = apply_rope(_linear_heads(x, self.k_proj, self.head_dim), cos, sin)
        v = _linear_heads(x, self.v_proj, self.head_dim)
        out = backend.forward(q, k, v, self.attn, batch)
        return self.o_proj(out.reshape(x.shape[0], -1))


class CrossAttention(nn.Module):
    """Decoder-to-encoder attention; its K/V live in the request's encoder slots of the layer's buffer."""

    def __init__(self, cfg: T5GemmaStackConfig, layer_idx: int, encoder_hidden_size: int):
        super().__init__()
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.head_dim = d
        self.attn = AttentionLayer(
            layer_id=layer_idx,
            num_q_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=d,
            scaling=cfg.scaling,
            sliding_window=None,
            logit_softcap=cfg.attn_softcap,
            is_cross_attention=True,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(encoder_hidden_size, kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(encoder_hidden_size, kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(heads * d, cfg.hidden_size, bias=cfg.attention_bias)

    def write_kv(self, encoder_hidden: torch.Tensor, loc: torch.Tensor, backend: AttentionBackend) -> None:
        """Project encoder_hidden [N, enc_hidden] to K/V and store them at encoder slots loc [N]."""
        k = _linear_heads(encoder_hidden, self.k_proj, self.head_dim)
        v = _linear_heads(encoder_hidden, self.v_proj, self.head_dim)
        backend.save_kv(self.attn, loc, k, v)

    def forward(self, x, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        q = _linear_heads(x, self.q_proj, self.head_dim)
        out = backend.forward(q, None, None, self.attn, batch, save_kv_cache=False)
        return self.o_proj(out.reshape(x.shape[0], -1))


class T5GemmaEncoderLayer(nn.Module):
    def __init__(self, cfg: T5GemmaStackConfig, layer_idx: int):
        super().__init__()
        self.self_attn = EncoderSelfAttention(cfg, layer_idx)
        self.pre_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_activation)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen: int, varlen_attention: Callable) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        h = self.self_attn(
            self.pre_self_attn_layernorm(x), cos, sin, cu_seqlens, max_seqlen, varlen_attention
        )
        x = x + self.post_self_attn_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class T5GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: T5GemmaStackConfig, layer_idx: int, encoder_hidden_size: int):
        super().__init__()
        self.self_attn = DecoderSelfAttention(cfg, layer_idx)
        self.pre_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.cross_attn = CrossAttention(cfg, layer_idx, encoder_hidden_size)
        self.pre_cross_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_cross_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_activation)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        x = x + self.post_self_attn_layernorm(
            self.self_attn(self.pre_self_attn_layernorm(x), cos, sin, batch, backend)
        )
        x = x + self.post_cross_attn_layernorm(
            self.cross_attn(self.pre_cross_attn_layernorm(x), batch, backend)
        )
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def _scaled_embedding(embed: nn.Embedding, ids: torch.Tensor, hidden_size: int) -> torch.Tensor:
    x = embed(ids)
    # HF casts sqrt(hidden) to the activation dtype before multiplying (bf16 rounds it): do the same.
    return x * torch.tensor(hidden_size**0.5, dtype=x.dtype)


class T5GemmaEncoder(nn.Module):
    def __init__(self, cfg: T5GemmaStackConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(T5GemmaEncoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, cu_seqlens, max_seqlen: int, varlen_attention: Callable):
        """input_ids/positions int64 [N] packed by cu_seqlens int32 [B + 1] -> [N, hidden]."""
        x = _scaled_embedding(self.embed_tokens, input_ids, self.cfg.hidden_size)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, cu_seqlens, max_seqlen, varlen_attention)
        return self.norm(x)


class T5GemmaDecoder(nn.Module):
    def __init__(self, cfg: T5GemmaStackConfig, encoder_hidden_size: int):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            T5GemmaDecoderLayer(cfg, i, encoder_hidden_size) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """input_ids/positions int64 [T] (this step's tokens, packed) -> [T, hidden]."""
        x = _scaled_embedding(self.embed_tokens, input_ids, self.cfg.hidden_size)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, batch, backend)
        return self.norm(x)


class T5GemmaModel(nn.Module):
    def __init__(self, config: T5GemmaConfig):
        super().__init__()
        self.encoder = T5GemmaEncoder(config.encoder)
        self.decoder = T5GemmaDecoder(config.decoder, config.encoder.hidden_size)


class T5GemmaLMHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__()
        self.out_proj = nn.Linear(hidden_size, vocab_size, bias=False)


class T5GemmaForConditionalGeneration(nn.Module):
    """Encoder-decoder with an LM head; the engine calls encode, write_cross_kv, decode, compute_logits."""

    def __init__(self, config: T5GemmaConfig):
        super().__init__()
        self.config = config
        self.model = T5GemmaModel(config)
        # Tied checkpoints carry no lm_head tensor: the logits reuse the decoder embeddings.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else T5GemmaLMHead(config.decoder.hidden_size, config.decoder.vocab_size)
        )

    def decoder_attention_layers(self) -> list[AttentionLayer]:
        """Every decoder attention site (self then cross per layer), e.g. to size backends' wrappers."""
        layers = []
        for layer in self.model.decoder.layers:
            layers += [layer.self_attn.attn, layer.cross_attn.attn]
        return layers

    def encode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        varlen_attention: Callable = flash_attn_varlen_func,
    ) -> torch.Tensor:
        """Packed prompts int64 [N] (positions restart at 0 per prompt), cu_seqlens int32 [B + 1] -> [N, enc_hidden]."""
        return self.model.encoder(input_ids, positions, cu_seqlens, max_seqlen, varlen_attention)

    def write_cross_kv(
        self, encoder_hidden: torch.Tensor, loc: torch.Tensor, backend: AttentionBackend
    ) -> None:
        """Store every decoder layer's cross-attention K/V of encoder_hidden [N, enc_hidden] at encoder slots loc [N]."""
        for layer in self.model.decoder.layers:
            layer.cross_attn.write_kv(encoder_hidden, loc, backend)

    def decode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend
    ) -> torch.Tensor:
        """One decoder step over this step's tokens int64 [T] -> hidden [T, dec_hidden]."""
        return self.model.decoder(input_ids, positions, batch, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, dec_hidden] -> fp32 logits [B, vocab] with the final softcap applied."""
        weight = (
            self.model.decoder.embed_tokens.weight if self.lm_head is None else self.lm_head.out_proj.weight
        )
        logits = F.linear(hidden, weight).float()
        cap = self.config.decoder.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
