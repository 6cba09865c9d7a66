"""Qwen-Image's joint attention sequence: where each sample's text and image tokens sit, and its metadata.

Every block attends, per sample, over one sequence of that sample's own text tokens followed by its
image tokens (diffusers' order, so the sums run in the reference's order). The text stream is a
[B, L, ...] tensor padded to the batch's longest prompt; text_lens[b] of its L tokens are prompt.
Row b of the joint [B, L + N, H, D] tensors holds

    [text_b (text_lens[b]), image_b (N), the padding of text_b (L - text_lens[b])]

so the padding sits at the end of the row, where varlen AttentionMetadata (cu_seqlens over
text_lens[b] + N, the same for queries and keys) keeps it out of the keys and zeroes its queries.
No dense mask, no padded key is read. When no row is padded joining is a concatenation.

Both values are built once per model call from the lengths on the host (JointTokens.build) and
passed to every block.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmgen.attention.metadata import AttentionMetadata
from mmgen.errors import ValidationError


def _host_lengths(text_lens: torch.Tensor | Sequence[int], text_width: int | None) -> torch.Tensor:
    """int64 [B] on the CPU, each in [0, text_width] (a device tensor syncs here, once per call)."""
    lengths = torch.as_tensor(text_lens).detach().to("cpu", torch.int64).reshape(-1)
    if lengths.numel() == 0:
        raise ValidationError("text_lens is empty: one length per sample is needed")
    if int(lengths.min()) < 0 or (text_width is not None and int(lengths.max()) > text_width):
        bound = text_width if text_width is not None else "L"
        raise ValidationError(f"text_lens must lie in [0, {bound}], got {lengths.tolist()}")
    return lengths


def joint_attention_metadata(
    text_lens: torch.Tensor | Sequence[int],
    image_tokens: int,
    *,
    text_width: int | None = None,
    device: torch.device | str | None = None,
) -> AttentionMetadata:
    """The metadata of joint rows [text (text_lens[b]), image (image_tokens), padding].

    text_lens: int [B], each prompt's token count; text_width: the call's padded text length L
    (lengths above it raise; when every row fills it nothing is padded and the metadata is dense).
    Otherwise varlen rows: cu_seqlens_q = cu_seqlens_k = cumsum(text_lens + image_tokens), int32 on
    `device`, max_seqlen_q = max_seqlen_k = the longest row.
    """
    lengths = _host_lengths(text_lens, text_width)
    if text_width is not None and int(lengths.min()) == text_width:
        return AttentionMetadata()
    host = AttentionMetadata.from_lengths(lengths + image_tokens, lengths + image_tokens)
    cu = host.cu_seqlens_q if device is None else host.cu_seqlens_q.to(device, non_blocking=True)
    return AttentionMetadata(cu, cu, host.max_seqlen_q, host.max_seqlen_k)


@dataclass(frozen=True)
class JointTokens:
    """One model call's joint token sequence: its attention metadata and where the text and image tokens go.

    The call's attention metadata in the DiT call contract (mmgen.models.call: `metadata=`), built
    once from text_lens (JointTokens.build) and read by every block.

    text_index [B * L] / image_index [B * N]: int64 positions of the text and image tokens (flattened
    batch-major) in the flattened joint [B * (L + N)] rows (the fused block path writes its q and k
    there directly); when no row is padded the metadata is dense and joining is
    torch.cat([text, image], 1). Never mutated.
    """

    metadata: AttentionMetadata
    text_width: int
    image_tokens: int
    text_index: torch.Tensor
    image_index: torch.Tensor
    text_lens: tuple[int, ...]

    @functools.cached_property
    def key_metadata(self) -> AttentionMetadata:
        """The metadata with the key lengths only: padded query rows are computed (each over its own
        sample's keys) but not zeroed, for callers that never read them (one pass fewer)."""
        meta = self.metadata
        return AttentionMetadata(None, meta.cu_seqlens_k, None, meta.max_seqlen_k)

    def image_rows(self, sample: int) -> slice:
        """Where sample's image tokens sit in the flattened joint [B * (L + N)] rows (contiguous)."""
        start = sample * (self.text_width + self.image_tokens) + self.text_lens[sample]
        return slice(start, start + self.image_tokens)

    @staticmethod
    def build(
        text_lens: torch.Tensor | Sequence[int],
        image_tokens: int,
        *,
        text_width: int,
        device: torch.device | str | None = None,
    ) -> JointTokens:
        """The joint tokens for text_lens [B] (each in [0, text_width]) and image_tokens image tokens per sample."""
        metadata = joint_attention_metadata(text_lens, image_tokens, text_width=text_width, device=device)
        lengths = _host_lengths(text_lens, text_width)
        row = text_width + image_tokens
        starts = torch.arange(lengths.numel())[:, None] * row
        column = torch.arange(text_width)[None, :]
        # Prompt token j stays at j; padding token j moves past the image tokens, to j + N.
        text_index = starts + torch.where(column < lengths[:, None], column, column + image_tokens)
        image_index = starts + lengths[:, None] + torch.arange(image_tokens)[None, :]
        return JointTokens(
            metadata,
            text_width,
            image_tokens,
            text_index.reshape(-1).to(device, non_blocking=True),
            image_index.reshape(-1).to(device, non_blocking=True),
            tuple(lengths.tolist()),
        )

    def join(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        """text [B, L, H, D], image [B, N, H, D] -> the joint rows [B, L + N, H, D]."""
        if self.metadata.is_dense:
            return torch.cat([text, image], dim=1)
        batch = text.shape[0]
        joint = text.new_empty(batch * (self.text_width + self.image_tokens), *text.shape[2:])
        joint.index_copy_(0, self.text_index, text.reshape(-1, *text.shape[2:]))
        joint.index_copy_(0, self.image_index, image.reshape(-1, *image.shape[2:]))
        return joint.view(batch, -1, *text.shape[2:])

    def split(self, joint: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The joint rows [B, L + N, H, D] -> text [B, L, H, D], image [B, N, H, D] (join's inverse)."""
        if self.metadata.is_dense:
            return joint[:, : self.text_width], joint[:, self.text_width :]
        flat = joint.reshape(-1, *joint.shape[2:])
        text = flat.index_select(0, self.text_index).view(joint.shape[0], self.text_width, *joint.shape[2:])
        image = flat.index_select(0, self.image_index).view(
            joint.shape[0], self.image_tokens, *joint.shape[2:]
        )
        return text, image
