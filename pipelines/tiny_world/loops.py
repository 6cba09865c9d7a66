"""The tiny-world trainer's two loops (train.py runs them): the VAE, then the DiT and text encoder.

train_vae: reconstruction loss weighting the small foreground more than the background, plus a
light KL term. train_dit: rectified flow on the latent bank (data.py's conventions), captions
dropped to "" at CAPTION_DROPOUT for classifier-free guidance, the text encoder trained jointly, the
exported weights an exponential moving average (WeightAverage). Both: linear warmup then cosine
decay, a loss line every LOG_EVERY steps into the curve, and an optional deadline (--max-seconds).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from torch.nn.attention import SDPBackend, sdpa_kernel

from mmgen.default_model import TRANSFORMER, VAE, Z_DIM, text_encoder_config
from mmgen.loading.tokenizer import TextTokenizer
from mmgen.models.umt5 import UMT5Encoder
from pipelines.tiny_world.data import TIMESTEPS, encode_text, render_clips, shifted_sigmas, tokenize

CAPTION_DROPOUT = 0.1
VAE_LR, DIT_LR = 1e-3, 6e-4
EMA_DECAY = 0.999
FG_WEIGHT = 8.0  # extra reconstruction weight on foreground pixels (a few % of the frame)
KL_WEIGHT = 3e-4
LOG_EVERY = 100


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def scheduled_steps(
    optimizer: torch.optim.Optimizer,
    lr: float,
    steps: int,
    warmup: int,
    stage: str,
    deadline: float,
    curve: list,
) -> Iterator[int]:
    """Each step's index of `stage`, its learning rate set first (lr_factor), until `steps` or the
    deadline (past_deadline) ends the stage."""
    for step in range(steps):
        if past_deadline(deadline, stage, step, curve):
            return
        for group in optimizer.param_groups:
            group["lr"] = lr * lr_factor(step, steps, warmup)
        yield step


def train_vae(
    seed: int, steps: int, batch: int, device: torch.device, curve: list, deadline: float = math.inf
) -> torch.nn.Module:
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(**copy.deepcopy(VAE), latents_mean=[0.0] * Z_DIM, latents_std=[1.0] * Z_DIM)
    vae = vae.to(device).train()
    optimizer = torch.optim.Adam(vae.parameters(), lr=VAE_LR)
    rng = np.random.default_rng([seed, 1])
    noise_gen = torch.Generator().manual_seed(seed + 1)
    running = []
    started = time.time()
    for step in scheduled_steps(optimizer, VAE_LR, steps, max(1, steps // 20), "vae", deadline, curve):
        video, _ = render_clips(rng, batch, device)
        posterior = vae.encode(video).latent_dist
        eps = torch.randn(posterior.mean.shape, generator=noise_gen).to(device)
        z = posterior.mean + posterior.std * eps
        recon = vae.decode(z).sample
        # The background is most of the frame: weight pixels that differ from the corner colour.
        background = video[:, :, :, :1, :1]
        foreground = ((video - background).abs().sum(1, keepdim=True) > 0.05).float()
        weight = 1.0 + FG_WEIGHT * foreground
        reconstruction = (weight * (recon - video) ** 2).mean() / weight.mean()
        kl = 0.5 * (posterior.mean**2 + posterior.var - 1.0 - posterior.logvar).mean()
        loss = reconstruction + KL_WEIGHT * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        running.append((reconstruction.item(), kl.item()))
        if (step + 1) % LOG_EVERY == 0 or step + 1 == steps or step == 0:
            rec, kld = np.mean(running, axis=0)
            rate = (time.time() - started) / (step + 1)
            print(
                f"vae step {step + 1:5d}/{steps}  recon {rec:.5f}  kl {kld:.3f}  {rate:.3f} s/step",
                flush=True,
            )
            curve.append({"stage": "vae", "step": step + 1, "recon": float(rec), "kl": float(kld)})
            running = []
    return vae.eval()


def train_dit(
    latents: torch.Tensor,
    captions: list[str],
    tokenizer: TextTokenizer,
    seed: int,
    steps: int,
    batch: int,
    device: torch.device,
    curve: list,
    deadline: float = math.inf,
) -> tuple[torch.nn.Module, UMT5Encoder]:
    torch.manual_seed(seed + 3)
    # diffusers' module trains (mmgen's WanDiT is inference-only: its fused/out= row ops have no
    # backward); the state-dict keys are the same, and mmgen's parity tests hold the two equal.
    dit = WanTransformer3DModel(**TRANSFORMER.to_diffusers_config()).to(device).train()
    encoder = UMT5Encoder(text_encoder_config(tokenizer.vocab_size)).to(device).train()
    params = list(dit.parameters()) + list(encoder.parameters())
    optimizer = torch.optim.AdamW(params, lr=DIT_LR, weight_decay=0.0)
    ids, lengths = tokenize(tokenizer, captions)
    empty_ids, empty_len = tokenize(tokenizer, [""])
    empty_ids = F.pad(empty_ids, (0, ids.shape[1] - empty_ids.shape[1]), value=tokenizer.pad_id)
    ids, lengths = ids.to(device), lengths.to(device)
    empty_ids, empty_len = empty_ids.to(device), empty_len.to(device)
    gen = torch.Generator().manual_seed(seed + 4)
    average = WeightAverage(params)
    running = []
    started = time.time()
    for step in scheduled_steps(optimizer, DIT_LR, steps, max(1, steps // 25), "dit", deadline, curve):
        index = torch.randint(len(captions), (batch,), generator=gen).to(device)
        drop = (torch.rand(batch, generator=gen) < CAPTION_DROPOUT).to(device)
        batch_ids = torch.where(drop[:, None], empty_ids, ids[index])
        batch_len = torch.where(drop, empty_len, lengths[index])
        x0 = latents[index]
        eps = torch.randn(x0.shape, generator=gen).to(device)
        sigma = shifted_sigmas(torch.rand(batch, generator=gen)).to(device)
        s = sigma.view(-1, 1, 1, 1, 1)
        x_t = (1 - s) * x0 + s * eps
        # The math SDPA kernel: CUDA's memory-efficient attention backward is not deterministic.
        with sdpa_kernel(SDPBackend.MATH):
            text = encode_text(encoder, batch_ids, batch_len, TRANSFORMER.text_len)
            prediction = dit(x_t, sigma * TIMESTEPS, text, return_dict=False)[0]
        loss = F.mse_loss(prediction.float(), eps - x0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        average.update(params, step)
        running.append(loss.item())
        if (step + 1) % LOG_EVERY == 0 or step + 1 == steps or step == 0:
            mean = float(np.mean(running))
            rate = (time.time() - started) / (step + 1)
            print(f"dit step {step + 1:5d}/{steps}  flow loss {mean:.5f}  {rate:.3f} s/step", flush=True)
            curve.append({"stage": "dit", "step": step + 1, "loss": mean})
            running = []
    average.copy_to(params)
    return dit.eval(), encoder.eval()


class WeightAverage:
    """An exponential moving average of parameters, the weights a diffusion trainer exports.

    The decay ramps up as min(EMA_DECAY, (1 + step) / (10 + step)), so the average forgets the
    random initialization within the first few hundred steps instead of ~1/(1 - EMA_DECAY).
    """

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.shadow = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self, params: list[torch.nn.Parameter], step: int) -> None:
        decay = min(EMA_DECAY, (1 + step) / (10 + step))
        torch._foreach_lerp_(self.shadow, [p.detach() for p in params], 1.0 - decay)

    @torch.no_grad()
    def copy_to(self, params: list[torch.nn.Parameter]) -> None:
        for p, average in zip(params, self.shadow, strict=True):
            p.copy_(average)


def past_deadline(deadline: float, stage: str, step: int, curve: list) -> bool:
    """Whether a --max-seconds cap ends `stage` before `step` (recorded in the curve: the run then
    differs from the uncapped schedule, which is what reproduces the shipped weights)."""
    if time.time() < deadline:
        return False
    print(f"{stage}: time cap reached, stopping before step {step + 1}", flush=True)
    curve.append({"stage": stage, "stopped_before_step": step + 1})
    return True
