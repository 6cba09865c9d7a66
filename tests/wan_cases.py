"""Pieces several Wan test files share: a tiny DiT config, diffusers' WanPipeline over a model directory,
and the tests' own key map between diffusers' WanTransformer3DModel and the original Wan layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmgen.models.wan import WanConfig

TINY = WanConfig(
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=4,
    out_channels=4,
    text_dim=32,
    freq_dim=32,
    ffn_dim=64,
    num_layers=3,
    rope_max_seq_len=32,
    text_len=16,
)


# diffusers' WanTransformer3DModel arguments of the DiT parity tests' tiny model, channels aside.
DIFFUSERS_TINY_DIT = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "text_dim": 32,
    "freq_dim": 32,
    "ffn_dim": 64,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 32,
}


def jittered_diffusers_dit(config: dict[str, Any]) -> Any:
    """diffusers' WanTransformer3DModel(**config) (seed 0, eval) with every weight moved off its
    default, so a swapped or missed tensor shows in a comparison."""
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(**config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def diffusers_wan_pipeline(directory: Path) -> Any:
    """diffusers' WanPipeline over the parts of a diffusers-format Wan directory (a fresh one per call:
    callers load LoRAs into it), progress bars off."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5EncoderModel

    pipe = WanPipeline(
        tokenizer=AutoTokenizer.from_pretrained(directory / "tokenizer"),
        text_encoder=UMT5EncoderModel.from_pretrained(directory / "text_encoder").eval(),
        vae=AutoencoderKLWan.from_pretrained(directory / "vae").eval(),
        scheduler=UniPCMultistepScheduler.from_pretrained(directory / "scheduler"),
        transformer=WanTransformer3DModel.from_pretrained(directory / "transformer").eval(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_to_original_key(key: str) -> str:
    """diffusers -> original Wan repository key (image-path keys included), written independently of
    mmgen.loading's map; test_wan_dit_parity checks it against diffusers' own converter."""
    pairs = [
        ("condition_embedder.image_embedder.norm1.", "img_emb.proj.0."),
        ("condition_embedder.image_embedder.ff.net.0.proj.", "img_emb.proj.1."),
        ("condition_embedder.image_embedder.ff.net.2.", "img_emb.proj.3."),
        ("condition_embedder.image_embedder.norm2.", "img_emb.proj.4."),
        ("condition_embedder.text_embedder.linear_1.", "text_embedding.0."),
        ("condition_embedder.text_embedder.linear_2.", "text_embedding.2."),
        ("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
        ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
        ("condition_embedder.time_proj.", "time_projection.1."),
        ("proj_out.", "head.head."),
        (".attn2.add_k_proj.", ".cross_attn.k_img."),
        (".attn2.add_v_proj.", ".cross_attn.v_img."),
        (".attn2.norm_added_k.", ".cross_attn.norm_k_img."),
        (".attn1.to_out.0.", ".self_attn.o."),
        (".attn2.to_out.0.", ".cross_attn.o."),
        (".attn1.to_", ".self_attn."),
        (".attn2.to_", ".cross_attn."),
        (".attn1.", ".self_attn."),
        (".attn2.", ".cross_attn."),
        (".norm2.", ".norm3."),
        (".ffn.net.0.proj.", ".ffn.0."),
        (".ffn.net.2.", ".ffn.2."),
    ]
    if key == "scale_shift_table":
        return "head.modulation"
    if key.endswith(".scale_shift_table"):
        return key.replace(".scale_shift_table", ".modulation")
    for new, old in pairs:
        if new in key:
            return key.replace(new, old)
    return key
