"""Pieces several Wan test files share: a tiny DiT config, diffusers' WanPipeline over a model directory,
and the tests' own key maps from diffusers' names to the original Wan layout's (the DiT, the VACE DiT,
the VAE, the T5 encoder)."""

from __future__ import annotations

import re
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


def diffusers_to_original_vace_key(key: str) -> str:
    """diffusers -> original Wan2.1-VACE key, written independently of mmgen.loading's map."""
    if key.startswith("vace_blocks."):
        index, rest = key[len("vace_blocks.") :].split(".", 1)
        for new, old in (("proj_in.", "before_proj."), ("proj_out.", "after_proj.")):
            if rest.startswith(new):
                return f"vace_blocks.{index}.{old}{rest[len(new) :]}"
        return "vace_" + diffusers_to_original_key(f"blocks.{index}.{rest}")
    return diffusers_to_original_key(key)


def vae_original_key(key: str, num_res_blocks: int) -> str:
    """diffusers AutoencoderKLWan name -> Wan2.1 WanVAE name (the original module tree); num_res_blocks:
    the VAE config's (each up stage holds one more, then its upsampler)."""
    per_up_stage = num_res_blocks + 1
    residual = {"norm1.gamma": "residual.0.gamma", "conv1.": "residual.2.", "norm2.gamma": "residual.3.gamma"}
    residual |= {"conv2.": "residual.6.", "conv_shortcut.": "shortcut."}

    def block(rest: str) -> str:
        for new, old in residual.items():
            if rest.startswith(new):
                return old + rest[len(new) :]
        return rest

    for new, old in (("quant_conv.", "conv1."), ("post_quant_conv.", "conv2.")):
        if key.startswith(new):
            return old + key[len(new) :]
    side, _, rest = key.partition(".")
    fixed = {"conv_in.": "conv1.", "norm_out.": "head.0.", "conv_out.": "head.2."}
    for new, old in fixed.items():
        if rest.startswith(new):
            return f"{side}.{old}{rest[len(new) :]}"
    if m := re.fullmatch(r"down_blocks\.(\d+)\.(.+)", rest):
        return f"{side}.downsamples.{m[1]}.{block(m[2])}"
    if m := re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d)\.(.+)", rest):
        index = {"resnets0": 0, "attentions0": 1, "resnets1": 2}[m[1] + m[2]]
        return f"{side}.middle.{index}.{block(m[3])}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", rest):
        return f"{side}.upsamples.{int(m[1]) * (per_up_stage + 1) + int(m[2])}.{block(m[3])}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.(.+)", rest):
        return f"{side}.upsamples.{int(m[1]) * (per_up_stage + 1) + per_up_stage}.{m[2]}"
    raise AssertionError(f"no original name for {key}")


def t5_original_key(key: str) -> str:
    """transformers UMT5 encoder name -> Wan's T5Encoder name (models_t5_umt5-xxl-enc-bf16.pth)."""
    names = {
        "layer.0.layer_norm.weight": "norm1.weight",
        "layer.0.SelfAttention.relative_attention_bias.weight": "pos_embedding.embedding.weight",
        "layer.1.layer_norm.weight": "norm2.weight",
        "layer.1.DenseReluDense.wi_0.weight": "ffn.gate.0.weight",
        "layer.1.DenseReluDense.wi_1.weight": "ffn.fc1.weight",
        "layer.1.DenseReluDense.wo.weight": "ffn.fc2.weight",
    } | {f"layer.0.SelfAttention.{p}.weight": f"attn.{p}.weight" for p in "qkvo"}
    if key == "shared.weight":
        return "token_embedding.weight"
    if key == "encoder.final_layer_norm.weight":
        return "norm.weight"
    m = re.fullmatch(r"encoder\.block\.(\d+)\.(.+)", key)
    return f"blocks.{m[1]}.{names[m[2]]}"
