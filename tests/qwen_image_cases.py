"""Pieces the Qwen-Image text and pipeline tests share: a tiny Qwen2 tokenizer written in both layouts,
a tiny random Qwen2.5-VL, transformer and VAE, and diffusers' QwenImagePipeline over them.

The tokenizer is a byte-level BPE (every byte one token, a few merges so merges.txt matters) with
Qwen's chat special tokens after the vocabulary, as Qwen2's vocab.json + merges.txt +
tokenizer_config.json (added_tokens_decoder) lay them out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2.5-VL's vision tokens after the chat tokens (Qwen-Image-Edit's tokenizer needs them).
VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
MERGES = (("a", "t"), ("Ġ", "c"), ("Ġc", "at"), ("Ġ", "a"), ("e", "d"), ("i", "m"))
TINY_TRANSFORMER = {
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 24,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "axes_dims_rope": (4, 10, 10),
}
TINY_VAE = {
    "base_dim": 8,
    "z_dim": 4,
    "dim_mult": [1, 2, 2, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
    "latents_mean": [0.1, -0.2, 0.3, 0.05],
    "latents_std": [1.5, 0.8, 1.2, 2.0],
}
# A FlowMatch Euler config with Qwen-Image's kind of schedule: dynamic (exponential) shift, terminal shift.
SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}


def write_tokenizer(directory: Path, specials: tuple[str, ...] = SPECIALS) -> None:
    """vocab.json + merges.txt + tokenizer_config.json of the tiny Qwen2 tokenizer (no tokenizer.json),
    `specials` its added tokens after the vocabulary."""
    from tokenizers import pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    pieces = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(pair) for pair in MERGES]
    vocab = {piece: index for index, piece in enumerate(pieces)}
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    lines = ["#version: 0.2", *(" ".join(pair) for pair in MERGES)]
    (directory / "merges.txt").write_text("\n".join(lines) + "\n")
    added = {
        str(len(vocab) + index): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for index, token in enumerate(specials)
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "bos_token": None,
        "model_max_length": 32768,
        "errors": "replace",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def hf_tokenizer(directory: Path) -> Any:
    """transformers' Qwen2Tokenizer read from `directory`."""
    import transformers

    return transformers.Qwen2Tokenizer.from_pretrained(str(directory))


def tiny_text_encoder(vocab_size: int, hidden_size: int = 32, **token_ids: int) -> Any:
    """A random two-layer Qwen2_5_VLForConditionalGeneration (float32, eval); token_ids: its
    image_token_id, vision_start_token_id, ... (Qwen-Image-Edit's encoder sees an image)."""
    import transformers

    text = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32}
    if token_ids:  # the encoder sees images: two vision blocks, windowed then full attention
        vision = {
            **vision,
            "depth": 2,
            "out_hidden_size": hidden_size,
            "window_size": 56,  # two merged patches a side: the first block attends in several windows
            "fullatt_block_indexes": [1],
        }
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **token_ids)
    torch.manual_seed(0)
    return transformers.Qwen2_5_VLForConditionalGeneration(config).eval()


def _random_like(name: str, value: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Weights that keep activations O(1), norms near 1, biases small (see test_qwen_image_model)."""
    noise = torch.randn(value.shape, generator=generator)
    if "norm" in name:
        return 1.0 + 0.1 * noise
    return noise * value.shape[1] ** -0.5 if value.dim() == 2 else 0.1 * noise


def tiny_transformer() -> Any:
    """diffusers' QwenImageTransformer2DModel of TINY_TRANSFORMER with O(1) random weights."""
    import diffusers

    torch.manual_seed(0)
    model = diffusers.QwenImageTransformer2DModel(**TINY_TRANSFORMER).eval()
    generator = torch.Generator().manual_seed(1)
    state = {name: _random_like(name, value, generator) for name, value in model.state_dict().items()}
    # Velocities O(1), as a trained model's: final latents stay O(1), so 1e-5 is a tight bound.
    state["proj_out.weight"] *= 0.25
    model.load_state_dict(state)
    return model


def tiny_vae() -> Any:
    import diffusers

    torch.manual_seed(2)
    return diffusers.AutoencoderKLQwenImage(**TINY_VAE).eval()


def write_qwen_image_dir(directory: Path) -> Path:
    """A diffusers-format Qwen-Image directory of the tiny parts (diffusers' save_pretrained), whose
    tokenizer/ holds vocab.json + merges.txt (as Qwen's release) rather than tokenizer.json."""
    import diffusers

    tokenizer_dir = directory / "tokenizer_source"
    write_tokenizer(tokenizer_dir)
    tokenizer = hf_tokenizer(tokenizer_dir)
    pipe = diffusers.QwenImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=tiny_vae(),
        text_encoder=tiny_text_encoder(len(tokenizer), TINY_TRANSFORMER["joint_attention_dim"]),
        tokenizer=tokenizer,
        transformer=tiny_transformer(),
    )
    target = directory / "qwen-image"
    pipe.save_pretrained(str(target))
    for name in ("tokenizer.json",):  # keep Qwen's layout: vocab.json + merges.txt
        (target / "tokenizer" / name).unlink(missing_ok=True)
    write_tokenizer(target / "tokenizer")
    return target


def write_comfy_lora(transformer: Any, path: Path) -> Path:
    """A ComfyUI-layout LoRA (rank 4, alpha 2, seeded) over every Linear of the transformer's blocks."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(8)
    state = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("transformer_blocks."):
            prefix = f"diffusion_model.{name}"
            state[f"{prefix}.lora_down.weight"] = torch.randn(4, module.in_features, generator=generator)
            state[f"{prefix}.lora_up.weight"] = 0.1 * torch.randn(module.out_features, 4, generator=generator)
            state[f"{prefix}.alpha"] = torch.tensor(2.0)
    save_file(state, str(path))
    return path


def check_offload_placement(pipe: Any, result: Any, offload: str) -> None:
    """A Qwen-Image-family pipeline loaded with `offload` ('model' or 'layer'): its result records the
    placement, 'model' loads the text encoder, the transformer and the VAE in turn ('layer' streams
    the transformer's blocks instead of loading it), and a request cannot ask for another placement."""
    import pytest

    from mmgen.errors import ValidationError

    assert result.args["memory_plan"]["offload"] == offload
    loads = [name for action, name in pipe.placement.log if action == "load"]
    assert loads == (["text_encoder", "expert0", "vae"] if offload == "model" else ["text_encoder", "vae"])
    assert (pipe.placement.stream is not None) == (offload == "layer")
    with pytest.raises(ValidationError, match="loaded with offload"):
        pipe("sky", offload="none", progress=False)
