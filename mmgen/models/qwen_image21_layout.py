"""Qwen-Image-2.1's joint sequence: where each token sits, its RoPE position, and the block-causal metadata.

Per sample, the text encoder's sequence (L_b tokens, the template's system prefix dropped) holds text
tokens and image slots; each slot stands for a 2x2 group of a condition image's latent tokens. The
joint sequence replaces each slot by its 4 latent tokens (the condition images fill the slots in
order, a block of h * w tokens each) and appends the target image's N tokens:

    [text, condition image 1, text, ..., condition image k, text] [target image]
    \\------------------------- prefix (p_b tokens) ------------/

The samples' joint sequences are packed one after the other with no padding (sample b's rows start at
`sample_starts[b]`), so prompts of different lengths share one call. Attention is block-causal: a
text token sees the keys up to itself, an image block every key up to its own end (its block
bidirectional, everything before it visible), never another sample's. That is expressed as segments
(mmgen.attention.segments): one causal segment per run of text tokens (its queries are the last
positions of keys [0, run end)) and one bidirectional segment per image block (its queries, keys
[0, end)), so the prefill is two varlen calls (the image blocks', the text runs') with no mask.

The cached step computes only the target tokens' queries, packed [B * N]; sample b's segment reads
the p_b + N keys of its packed rows in the prefill's key buffer (the prefix cached, the target's own
written at each step). Every sample uses its own lengths: a prompt's image in a batch equals the
same prompt's image alone (diffusers pads the batch's prompts to the longest, which shifts the
shorter prompts' image positions; mmgen does not).

RoPE positions (diffusers' QwenImage21Rope): a text token takes position c on all three axes and
advances c by one; an image block takes frame position c, height/width positions centred on zero,
and advances c by max(h, w).

Built once per generation on the host (the lengths never change across steps) and moved to the
device once; never mutated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmgen.attention.segments import SegmentMetadata
from mmgen.errors import ValidationError
from mmgen.models.qwen_image_blocks import centered_positions

TOKENS_PER_SLOT = 4  # one text-encoder image slot = a 2x2 group of latent tokens


@dataclass(frozen=True)
class _Sample:
    """One sample's joint sequence on the host: token kinds, positions and segments (sample-local)."""

    length: int
    text_joint: torch.Tensor  # int64 [text tokens]: joint index of each non-slot text token
    text_source: torch.Tensor  # int64 [text tokens]: its column in the text encoder's row
    image_joint: torch.Tensor  # int64 [image tokens]: joint index of each latent token, latent order
    positions: torch.Tensor  # int64 [length, 3]
    query_lengths: list[int]
    key_counts: list[int]
    causal: list[bool]


def _sample(slots: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> _Sample:
    """slots: bool [L_b] (True at image slots); grids: (1, h, w) of the condition images then the target."""
    repeats = torch.where(slots, TOKENS_PER_SLOT, 1)
    prefix_is_image = torch.repeat_interleave(slots, repeats)
    target = grids[-1][1] * grids[-1][2]
    is_image = torch.cat([prefix_is_image, torch.ones(target, dtype=torch.bool)])
    image_joint = is_image.nonzero().flatten()
    blocks = [h * w for _, h, w in grids]
    if sum(blocks) != image_joint.numel():
        raise ValidationError(
            f"the condition images' grids {list(grids[:-1])} hold {sum(blocks[:-1])} tokens but the prompt has "
            f"{int(slots.sum())} image slots ({int(slots.sum()) * TOKENS_PER_SLOT} tokens)"
        )
    text_source = (~slots).nonzero().flatten()
    text_joint = (torch.cumsum(repeats, 0) - 1)[text_source]
    frame, height, width, query_lengths, key_counts, causal = [], [], [], [], [], []
    cursor = position = 0
    block_starts = image_joint[torch.tensor([0, *blocks[:-1]]).cumsum(0)].tolist()
    for (_, h, w), start in zip(grids, block_starts, strict=True):
        run = torch.arange(position, position + start - cursor)
        frame.append(run)
        height.append(run)
        width.append(run)
        if start > cursor:  # the text run before this block: one causal segment
            query_lengths.append(start - cursor)
            key_counts.append(start)
            causal.append(True)
        position += start - cursor
        frame.append(torch.full((h * w,), position))
        height.append(centered_positions(h, "cpu").repeat_interleave(w))
        width.append(centered_positions(w, "cpu").repeat(h))
        query_lengths.append(h * w)
        key_counts.append(start + h * w)
        causal.append(False)
        position += max(h, w)
        cursor = start + h * w
    positions = torch.stack([torch.cat(frame), torch.cat(height), torch.cat(width)], dim=1)
    return _Sample(
        is_image.numel(), text_joint, text_source, image_joint, positions, query_lengths, key_counts, causal
    )


@dataclass(frozen=True)
class BlockCausalLayout:
    """One generation's packed joint sequences (the module docstring). Index tensors live on the device.

    text_source [Nt] / text_rows [Nt]: flattened [B * L] text-encoder rows -> packed joint rows.
    image_rows [B * Ni]: the flattened latents [B * Ni] (condition images then target) -> joint rows.
    target_rows [B * N]: each sample's target tokens in the joint rows (also the cache rows they write).
    modulation_rows [T]: which row of the [B + 1] modulation table a joint token reads (text and
    condition tokens the t = 0 row B, target tokens their sample's row); sample_rows [T]: its sample.
    positions [T, 3]: RoPE positions (frame, height, width) of the joint rows.
    prefill / cached: the segment metadata of the full call and of the cached (target-only) call.
    signature: what build made it from (text_lens, grids, text_width, each sample's slot positions):
    equal signatures, equal tensors (a kept CUDA graph's replays read the first one's).
    """

    batch: int
    text_width: int
    target_tokens: int
    latent_tokens: int
    sample_starts: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    text_source: torch.Tensor
    text_rows: torch.Tensor
    image_rows: torch.Tensor
    target_rows: torch.Tensor
    modulation_rows: torch.Tensor
    sample_rows: torch.Tensor
    positions: torch.Tensor
    prefill: SegmentMetadata
    cached: SegmentMetadata
    signature: tuple = ()

    @property
    def total_tokens(self) -> int:
        return self.prefill.total_q

    @staticmethod
    def build(
        text_lens: Sequence[int],
        grids: Sequence[tuple[int, int, int]],
        *,
        text_width: int,
        slot_masks: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> BlockCausalLayout:
        """text_lens [B]: each sample's text-encoder tokens (in [1, text_width]); grids: (1, h, w) token
        grids of the condition images then the target, shared by every sample; slot_masks: bool
        [B, text_width], True at image slots (None: text only)."""
        grids = tuple(tuple(int(x) for x in grid) for grid in grids)
        if not grids or any(len(g) != 3 or g[0] != 1 or min(g) < 1 for g in grids):
            raise ValidationError(f"grids must be (1, height, width) token grids, got {list(grids)}")
        lens = [int(n) for n in text_lens]
        if not lens or min(lens) < 1 or max(lens) > text_width:
            raise ValidationError(f"text_lens must lie in [1, {text_width}], got {lens}")
        if slot_masks is not None and tuple(slot_masks.shape) != (len(lens), text_width):
            raise ValidationError(
                f"slot_masks {tuple(slot_masks.shape)}: expected [B={len(lens)}, L={text_width}]"
            )
        target = grids[-1][1] * grids[-1][2]
        latent_tokens = sum(h * w for _, h, w in grids)
        samples, starts, offset, slot_positions = [], [], 0, []
        for b, n in enumerate(lens):
            slots = torch.zeros(n, dtype=torch.bool) if slot_masks is None else slot_masks[b, :n].cpu().bool()
            slot_positions.append(tuple(slots.nonzero().flatten().tolist()))
            samples.append(_sample(slots, grids))
            starts.append(offset)
            offset += samples[-1].length
        total = offset
        batch = len(lens)
        prefix = [s.length - target for s in samples]
        target_rows = torch.cat(
            [torch.arange(o + p, o + p + target) for o, p in zip(starts, prefix, strict=True)]
        )
        sample_rows = torch.cat([torch.full((s.length,), b) for b, s in enumerate(samples)])
        modulation = torch.full((total,), batch, dtype=torch.int64)
        modulation[target_rows] = sample_rows[target_rows]
        prefill = SegmentMetadata.build(
            [n for s in samples for n in s.query_lengths],
            [o for s, o in zip(samples, starts, strict=True) for _ in s.query_lengths],
            [n for s in samples for n in s.key_counts],
            total,
            causal=[c for s in samples for c in s.causal],
            device=device,
        )
        cached = SegmentMetadata.build(
            [target] * batch, starts, [s.length for s in samples], total, device=device
        )
        return BlockCausalLayout(
            batch=batch,
            text_width=text_width,
            target_tokens=target,
            latent_tokens=latent_tokens,
            sample_starts=tuple(starts),
            prefix_lens=tuple(prefix),
            text_source=torch.cat([s.text_source + b * text_width for b, s in enumerate(samples)]).to(device),
            text_rows=torch.cat([s.text_joint + o for s, o in zip(samples, starts, strict=True)]).to(device),
            image_rows=torch.cat([s.image_joint + o for s, o in zip(samples, starts, strict=True)]).to(
                device
            ),
            target_rows=target_rows.to(device),
            modulation_rows=modulation.to(device),
            sample_rows=sample_rows.to(device),
            positions=torch.cat([s.positions for s in samples]).to(device),
            prefill=prefill,
            cached=cached,
            signature=(tuple(lens), grids, text_width, tuple(slot_positions)),
        )
