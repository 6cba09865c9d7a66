"""Load an HF-format T5Gemma directory: config.json (nested encoder/decoder), safetensors, tokenizer.json.

generation_config.json, when present, supplies decoder_start_token_id and the eos ids (instruction
tuned checkpoints list several, e.g. <eos> and <end_of_turn>); otherwise they come from config.json,
with HF's fallback of the decoder's bos_token_id as the decoder start token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mmgen.errors import LoadError, MmgenError
from mmgen.llm.models.t5gemma import T5GemmaConfig, T5GemmaForConditionalGeneration, T5GemmaStackConfig
from mmgen.loading.safetensors_dir import find_weight_files, load_into_module, read_json, read_tensors
from mmgen.loading.tokenizer import TextTokenizer

STACK_DEFAULTS = {
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
}
STACK_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


class GenerationTokenizer:
    """tokenizer.json for generation: text -> ids with the file's special tokens, ids -> text."""

    def __init__(self, text_tokenizer: TextTokenizer):
        self.tokenizer = text_tokenizer.tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@dataclass
class LoadedT5Gemma:
    model: T5GemmaForConditionalGeneration
    config: T5GemmaConfig
    tokenizer: GenerationTokenizer | None
    source: Path


def _stack_config(raw: dict, where: str) -> T5GemmaStackConfig:
    missing = [k for k in STACK_REQUIRED if k not in raw]
    if missing:
        raise LoadError(f"{where}: missing {', '.join(missing)}")
    for key in STACK_REQUIRED:  # read below (layer_types) before the config checks them
        if not _is_int(raw[key]):
            raise LoadError(f"{where}: {key} = {raw[key]!r}, must be an integer")
    values = {k: raw.get(k, default) for k, default in STACK_DEFAULTS.items()}
    values.update({k: raw[k] for k in STACK_REQUIRED})
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise LoadError(f"{where}: rope_parameters / rope_scaling = {rope!r}, must be an object")
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise LoadError(f"{where}: rope_type={rope_type!r} not supported (only 'default')")
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(raw["num_hidden_layers"])
    ]
    try:
        return T5GemmaStackConfig(**values, rope_theta=float(theta), layer_types=tuple(layer_types))
    except MmgenError as err:
        raise LoadError(f"{where}: {err}") from err


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _id_list(value: object, where: Path) -> tuple[int, ...]:
    ids = () if value is None else tuple(value) if isinstance(value, list) else (value,)
    if not all(_is_int(i) for i in ids):
        raise LoadError(f"{where}: eos_token_id = {value!r}, must be a token id or a list of them")
    return ids


def read_t5gemma_config(directory: Path) -> T5GemmaConfig:
    """Parse directory/config.json (+ generation_config.json) into a frozen T5GemmaConfig."""
    path = Path(directory) / "config.json"
    raw = read_json(path)
    if raw.get("model_type") != "t5gemma":
        raise LoadError(f"{path}: model_type={raw.get('model_type')!r}, expected 't5gemma'")
    for part in ("encoder", "decoder"):
        if not isinstance(raw.get(part), dict):
            raise LoadError(f"{path}: no {part!r} sub-config")
    encoder = _stack_config(raw["encoder"], f"{path} [encoder]")
    decoder = _stack_config(raw["decoder"], f"{path} [decoder]")
    gen_path = Path(directory) / "generation_config.json"
    gen = read_json(gen_path) if gen_path.is_file() else {}
    start = gen.get("decoder_start_token_id", raw.get("decoder_start_token_id"))
    if start is None:
        start = raw["decoder"].get("bos_token_id", raw.get("bos_token_id"))
    if start is None:
        raise LoadError(f"{path}: no decoder_start_token_id or decoder bos_token_id")
    if not _is_int(start):
        where = gen_path if "decoder_start_token_id" in gen else path
        raise LoadError(f"{where}: decoder start token = {start!r}, must be a token id")
    eos_where = gen_path if "eos_token_id" in gen else path
    eos = _id_list(
        gen.get("eos_token_id", raw["decoder"].get("eos_token_id", raw.get("eos_token_id"))), eos_where
    )
    return T5GemmaConfig(
        encoder=encoder,
        decoder=decoder,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        decoder_start_token_id=start,
        eos_token_ids=eos,
        pad_token_id=int(raw["decoder"].get("pad_token_id", raw.get("pad_token_id", 0)) or 0),
    )


def load_t5gemma(
    directory: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    with_tokenizer: bool = True,
) -> LoadedT5Gemma:
    """Build the model on the meta device and assign the checkpoint's tensors (one copy in memory)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise LoadError(f"{directory}: model directory not found")
    config = read_t5gemma_config(directory)
    with torch.device("meta"):
        model = T5GemmaForConditionalGeneration(config)
    files = find_weight_files(directory)
    tensors = read_tensors(files)
    # A tied checkpoint may still carry the head; the model reads the decoder embeddings instead.
    tied = config.tie_word_embeddings
    load_into_module(
        model,
        tensors,
        source=directory,
        dtype=dtype,
        device=device,
        rename=lambda key: None if tied and key == "lm_head.out_proj.weight" else key,
    )
    model.eval()
    tokenizer = None
    if with_tokenizer and (directory / "tokenizer.json").is_file():
        tokenizer = GenerationTokenizer(TextTokenizer.from_dir(directory))
    return LoadedT5Gemma(model=model, config=config, tokenizer=tokenizer, source=directory)
