"""Text tokenization through the `tokenizers` library, read from a diffusers `tokenizer/` directory.

`TextTokenizer.encode` pads and truncates exactly as transformers' fast tokenizers do with
`padding="max_length", truncation=True, add_special_tokens=True`: the text is cut so that the special
tokens the post-processor appends (T5's `</s>`) still fit, then padded on the right.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import Unigram

from mmgen.errors import LoadError, ValidationError
from mmgen.loading.safetensors_dir import read_json

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
METASPACE = "\u2581"


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json / special_tokens_map.json write it (string or dict)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TextTokenizer:
    """A `tokenizers.Tokenizer` with the pad token and length limit of its directory's configs."""

    def __init__(
        self, tokenizer: Tokenizer, *, pad_token: str, model_max_length: int | None, source: Path
    ) -> None:
        pad_id = tokenizer.token_to_id(pad_token)
        if pad_id is None:
            raise LoadError(f"{source}: pad token {pad_token!r} is not in the vocabulary")
        # encode() truncates and pads per call; settings stored in tokenizer.json must not apply twice.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.tokenizer = tokenizer
        self.pad_token = pad_token
        self.pad_id = pad_id
        self.model_max_length = model_max_length
        self.source = source

    @classmethod
    def from_dir(cls, directory: Path) -> TextTokenizer:
        """Load `directory/tokenizer.json`; the pad token and model_max_length come from the JSON configs."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise LoadError(f"{path}: file not found (mmgen reads tokenizers from tokenizer.json)")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # the Rust side raises a bare Exception for malformed files
            raise LoadError(f"{path}: not a readable tokenizer.json ({err})") from err
        settings: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            if (directory / name).is_file():
                settings.update(read_json(directory / name))  # tokenizer_config.json wins, as in HF
        pad_token = _token_text(settings.get("pad_token")) or PAD
        max_length = settings.get("model_max_length")
        # HF writes a huge sentinel (1e30) for "no limit".
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length > 10**9:
            max_length = None
        return cls(tokenizer, pad_token=pad_token, model_max_length=max_length, source=directory)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can emit, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, prompts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts -> (input_ids int64 [B, max_length], attention_mask int64 [B, max_length]), right-padded."""
        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise ValidationError("prompts must be a list of strings")
        n_special = self.tokenizer.num_special_tokens_to_add(is_pair=False)
        if not isinstance(max_length, int) or max_length <= n_special:
            raise ValidationError(
                f"max_length = {max_length!r}, must be an integer > {n_special} (the special tokens it adds)"
            )
        ids = torch.full((len(prompts), max_length), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(prompts), max_length), dtype=torch.int64)
        for row, encoding in enumerate(self.tokenizer.encode_batch(prompts, add_special_tokens=False)):
            # Cut the text first so the appended special tokens survive truncation, as transformers does.
            encoding.truncate(max_length - n_special)
            tokens = self.tokenizer.post_process(encoding, add_special_tokens=True).ids
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            mask[row, : len(tokens)] = 1
        return ids, mask


def build_word_tokenizer(vocab_words: list[str], directory: Path, *, model_max_length: int = 512) -> None:
    """Write a small deterministic T5-style tokenizer (tokenizer.json + configs) into `directory`.

    Ids: 0 `<pad>`, 1 `</s>`, 2 `<unk>`, 3 the bare word boundary, then one piece per word
    ("\u2581word", in the given order), then one piece per distinct character of the words (sorted), so
    unseen words made of known characters still tokenize. A Unigram model with T5's pre-tokenizer
    (whitespace split + Metaspace) and a post-processor appending `</s>`: exactly the pipeline
    transformers' T5Tokenizer rebuilds from this vocabulary, so both give the same ids.
    """
    words = list(vocab_words)
    bad = [w for w in words if not isinstance(w, str) or not w or any(c.isspace() for c in w)]
    if bad:
        raise ValidationError(f"vocab_words must be non-empty strings without whitespace, got {bad[:3]!r}")
    if len(set(words)) != len(words):
        raise ValidationError("vocab_words contains duplicates")
    chars = sorted({c for w in words for c in w})
    # Equal scores make whole words win over character splits (fewer pieces, higher total score).
    pieces = [(PAD, 0.0), (EOS, 0.0), (UNK, 0.0), (METASPACE, -2.0)]
    pieces += [(METASPACE + w, -1.0) for w in words]
    pieces += [(c, -3.0) for c in chars]
    names = [p for p, _ in pieces]
    if len(set(names)) != len(names):
        raise ValidationError("vocab_words collide with the special tokens or with each other")
    tokenizer = Tokenizer(Unigram(pieces, unk_id=2, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="always", split=True),
        ]
    )
    tokenizer.decoder = decoders.Metaspace(replacement=METASPACE, prepend_scheme="always", split=True)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}", special_tokens=[(EOS, 1)]
    )
    tokenizer.add_special_tokens([PAD, EOS, UNK])
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    special = {"pad_token": PAD, "eos_token": EOS, "unk_token": UNK}
    config = {
        "tokenizer_class": "T5Tokenizer",
        **special,
        "extra_ids": 0,
        "additional_special_tokens": [],
        "model_max_length": model_max_length,
        "padding_side": "right",
        "truncation_side": "right",
    }
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
