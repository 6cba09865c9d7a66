"""Load a UMT5 text encoder from a transformers-format directory (config.json + safetensors shards)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from mmgen.errors import LoadError, ValidationError
from mmgen.loading.safetensors_dir import (
    Reads,
    checkpoint_bytes,
    find_weight_files,
    load_into_module,
    read_json,
    read_tensors,
    tensor_offsets,
)
from mmgen.models.umt5 import UMT5Config, UMT5Encoder
from mmgen.placement.tensors import PinnedStore

# A full encoder-decoder checkpoint (UMT5Model / UMT5ForConditionalGeneration) also holds these; the
# encoder never reads them.
UNUSED_PREFIXES = ("decoder.", "lm_head.")
TIED_EMBEDDING_ALIAS = "encoder.embed_tokens.weight"
# the feed-forward output projections an fp16 model keeps in fp32 (encoder.block.N.layer.1.DenseReluDense.wo)
FP16_KEPT_FP32 = ".layer.1.DenseReluDense.wo.weight"


def read_umt5_config(directory: Path) -> UMT5Config:
    """The UMT5Config of `directory/config.json`, with LoadErrors naming the file."""
    path = Path(directory) / "config.json"
    hf = read_json(path)
    model_type = hf.get("model_type", "umt5")
    if model_type != "umt5":
        raise LoadError(f"{path}: model_type {model_type!r} is not supported here; expected 'umt5'")
    try:
        return UMT5Config.from_hf_config(hf)
    except (ValidationError, TypeError, ValueError) as err:  # e.g. an unhashable dense_act_fn
        raise LoadError(f"{path}: {err}") from err


def load_umt5_encoder(
    directory: Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    host: PinnedStore | None = None,
    read: Reads = True,
    keep: bool = True,
) -> UMT5Encoder:
    """A UMT5Encoder in eval mode with the weights of `directory`, allocated once on `device` in `dtype`.

    Like transformers, an fp16 model keeps the feed-forward output projections (`wo`) in fp32 (read
    from the checkpoint in fp32: no bits lost to an fp16 copy).
    host: a PinnedStore to read the weights into (see load_into_module).
    read: what of the weights is read (load_into_module's `read`: all, none, or a rank's part,
    mmgen.parallel.share.SplitReads). keep: whether this process keeps the encoder: the tensors it does
    not read are allocated on `device` (to be filled by the ranks that read them, share_reads); False:
    left on the meta device. read=False, keep=False is the structure alone (every check and dtype a load
    makes, no byte read or allocated): its config and sizes for memory plans, on a rank that receives
    its text from the one that encodes (mmgen.parallel.share.reads_for_world).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise LoadError(f"{directory}: text encoder directory not found")
    config = read_umt5_config(directory)
    tensors = read_tensors(find_weight_files(directory))
    rename = _renamed(has_shared="shared.weight" in tensors)
    with torch.device("meta"):
        model = UMT5Encoder(config)
    load_into_module(
        model,
        tensors,
        source=directory,
        dtype=dtype,
        device=device,
        rename=rename,
        ignore=lambda key: key.startswith(UNUSED_PREFIXES),
        keep_fp32=lambda name: dtype == torch.float16 and name.endswith(FP16_KEPT_FP32),
        host=host if keep else None,
        read=read,
        keep_unread=keep,
    )
    return model.eval()


def umt5_bytes(directory: Path) -> int:
    """The checkpoint bytes a load of `directory` reads (a decoder's and a tied alias's not counted): the
    text encoder's part of a world's split reads (mmgen.parallel.share.ReadPart)."""
    files = find_weight_files(Path(directory))
    rename = _renamed(has_shared=any("shared.weight" in tensor_offsets(path) for path in files))
    return checkpoint_bytes(
        files, counted=lambda key: not key.startswith(UNUSED_PREFIXES) and rename(key) is not None
    )


def _renamed(has_shared: bool) -> Callable[[str], str | None]:
    """The checkpoint key -> parameter name map: HF ties encoder.embed_tokens to shared, and a checkpoint
    may hold either name or both (the same tensor)."""

    def rename(key: str) -> str | None:
        if key == TIED_EMBEDDING_ALIAS:
            return None if has_shared else "shared.weight"
        return key

    return rename
