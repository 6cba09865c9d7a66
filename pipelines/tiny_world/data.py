"""What the tiny-world trainer (train.py) feeds its models, in the conventions the pipeline samples in.

Rendered training clips (video in [-1, 1]) and their captions, the bank of VAE latents the DiT trains
on, captions -> text states zero-padded to the DiT's text_len exactly as the pipeline pads them, and
the flow-matching noise levels (sigma shifted by the scheduler's flow_shift; the model's timestep is
TIMESTEPS * sigma). tests/test_tiny_train.py holds these to what the pipeline does at inference.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mmgen.default_model import DEFAULTS, SCHEDULER
from mmgen.loading.tokenizer import TextTokenizer
from mmgen.models.umt5 import TextPadding, UMT5Encoder
from mmgen.tiny.world import render_batch, sample_scene, scene_parameters

SIZE = DEFAULTS.height
NUM_FRAMES = DEFAULTS.num_frames
FLOW_SHIFT = SCHEDULER["flow_shift"]
TIMESTEPS = 1000  # diffusers' num_train_timesteps: the model's timestep is 1000 * sigma


def render_clips(
    rng: np.random.Generator, count: int, device: torch.device
) -> tuple[torch.Tensor, list[str]]:
    """`count` training scenes -> (video in [-1, 1] float32 [N, 3, T, H, W] on device, captions)."""
    scenes = [sample_scene(rng, "train") for _ in range(count)]
    frames = render_batch(scene_parameters(scenes, device), size=SIZE, num_frames=NUM_FRAMES)
    video = frames.permute(0, 4, 1, 2, 3) / 127.5 - 1.0
    return video, [s.caption for s in scenes]


@torch.no_grad()
def encode_bank(
    vae: torch.nn.Module, seed: int, count: int, device: torch.device
) -> tuple[torch.Tensor, list[str]]:
    """`count` training clips -> (posterior means float32 [N, Z, 3, 12, 12] on device, captions)."""
    rng = np.random.default_rng([seed, 2])
    latents, captions = [], []
    for start in range(0, count, 200):
        video, names = render_clips(rng, min(200, count - start), device)
        latents.append(vae.encode(video).latent_dist.mean)
        captions += names
    return torch.cat(latents), captions


def tokenize(tokenizer: TextTokenizer, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Captions -> (ids int64 [N, L], lengths int64 [N]) with L the longest caption's token count."""
    ids, mask = tokenizer.encode(captions, 64)
    length = int(mask.sum(1).max())
    return ids[:, :length], mask.sum(1)


def encode_text(
    encoder: UMT5Encoder, ids: torch.Tensor, lengths: torch.Tensor, text_len: int
) -> torch.Tensor:
    """ids [B, L], lengths [B] -> [B, text_len, d]: each prompt's states, zeros after it (the pipeline's input).

    The encoder masks padding keys, so states of real tokens do not depend on L: encoding the
    short batch and zero-padding equals the pipeline's encoding at text_len.
    """
    padding = TextPadding(lengths)
    hidden = encoder(ids, padding)
    valid = padding.valid_mask(ids.shape[1]).to(hidden.device)[..., None]
    hidden = torch.where(valid, hidden, torch.zeros((), device=hidden.device))
    return F.pad(hidden, (0, 0, 0, text_len - ids.shape[1]))


def shifted_sigmas(u: torch.Tensor) -> torch.Tensor:
    """Uniform u in (0, 1) -> sigma with the scheduler's flow shift applied (more time at high noise)."""
    return FLOW_SHIFT * u / (1 + (FLOW_SHIFT - 1) * u)
