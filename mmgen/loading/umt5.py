"""Load a UMT5 text encoder from a transformers-format directory (config.json + safetensors shards)."""

from __future__ import annotations

from pathlib import Path

import torch

from mmgen.errors import LoadError, ValidationError
from mmgen.loading.safetensors_dir import find_weight_files, load_into_module, read_json, read_tensors
from mmgen.models.umt5 import UMT5Config, UMT5Encoder
from mmgen.placement.tensors import PinnedStore

# A full encoder-decoder checkpoint (UMT5Model / UMT5ForConditionalGeneration) also holds these; the
# encoder never reads them.
UNUSED_PREFIXES = ("decoder.", "lm_head.")
TIED_EMBEDDING_ALIAS = "encoder.embed_tokens.weight"


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
    weights: bool = True,
) -> UMT5Encoder:
    """A UMT5Encoder in eval mode with the weights of `directory`, allocated once on `device` in `dtype`.

    Like transformers, an fp16 model keeps the feed-forward output projections (`wo`) in fp32.
    host: a PinnedStore to read the weights into (see load_into_module).
    weights: False = the structure only, on the meta device (every check and dtype a load makes, no byte
    read: load_into_module(read=False)): its config and sizes for memory plans, on a rank that receives its
    text from the one that encodes (mmgen.parallel.share.reads_for_world).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise LoadError(f"{directory}: text encoder directory not found")
    config = read_umt5_config(directory)
    if not weights:
        device, host = "meta", None
    tensors = read_tensors(find_weight_files(directory))
    # HF ties encoder.embed_tokens to shared; a checkpoint may hold either name or both (same tensor).
    has_shared = "shared.weight" in tensors

    def rename(key: str) -> str | None:
        if key == TIED_EMBEDDING_ALIAS:
            return None if has_shared else "shared.weight"
        return key

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
        host=host,
        read=weights,
    )
    if dtype == torch.float16:
        # Re-read from the checkpoint tensor rather than upcasting the fp16 copy, so no bits are lost
        # (onto the meta device a conversion reads nothing).
        for i, block in enumerate(model.encoder.block):
            source = tensors[f"encoder.block.{i}.layer.1.DenseReluDense.wo.weight"][0]
            wo = block.layer[1].DenseReluDense.wo
            wo.weight = torch.nn.Parameter(source.to(device=device, dtype=torch.float32))
    return model.eval()
