"""Sampling parameters and the per-request token choice (greedy, or temperature / top-k / top-p)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from mmgen.errors import ValidationError


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes. temperature 0 = greedy; top_k 0 = off; top_p 1 = off.

    seed: the request's own torch.Generator seed (None = a fresh random seed), so a seeded request
    samples the same tokens whatever else shares its batches. stop_token_ids: None = the model's eos
    ids, () = never stop early. return_logits: keep the fp32 logits of every step (tests, scoring).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    return_logits: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValidationError(f"max_new_tokens = {self.max_new_tokens!r}, must be an integer >= 1")
        if not self.temperature >= 0.0:
            raise ValidationError(f"temperature = {self.temperature!r}, must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValidationError(f"top_p = {self.top_p!r}, must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValidationError(f"top_k = {self.top_k!r}, must be an integer >= 0 (0 = off)")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise ValidationError(f"seed = {self.seed!r}, must be an integer in [0, 2**63)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def make_generator(self, device: torch.device) -> torch.Generator | None:
        """The request's own generator (None for greedy requests, which draw nothing)."""
        if self.greedy:
            return None
        generator = torch.Generator(device=device)
        generator.manual_seed(self.seed if self.seed is not None else secrets.randbits(63))
        return generator


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) on fp32 logits [V]; removed entries become -inf."""
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass (keeps >= 1).
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def choose_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """Next token of each request from fp32 logits [B, V]."""
    chosen = logits.argmax(dim=-1).tolist()
    for i, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        probs = torch.softmax(filter_logits(logits[i], p.temperature, p.top_k, p.top_p), dim=-1)
        chosen[i] = int(torch.multinomial(probs, 1, generator=generator).item())
    return chosen
