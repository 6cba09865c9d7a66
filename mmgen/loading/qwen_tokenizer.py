"""Qwen2's byte-level BPE tokenizer (Qwen-Image's) through the `tokenizers` library, from a `tokenizer/` directory.

Two layouts load: `tokenizer.json` (a fast tokenizer's file, as transformers saves it), or `vocab.json`
+ `merges.txt` with the added tokens of `tokenizer_config.json` (what Qwen's repositories ship). The
second is built as transformers' Qwen2Tokenizer builds it: NFC, Qwen2's split regex, byte-level
pieces, BPE without an unknown token, and the chat tokens (<|im_start|>, ...) at the ids the config
names. Qwen2's tokenizer adds no BOS/EOS, so a text's ids are its encoding as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from mmgen.errors import LoadError, ValidationError
from mmgen.loading.safetensors_dir import read_json

# transformers' Qwen2Tokenizer PRETOKENIZE_REGEX (the split before the byte-level step).
PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def qwen2_bpe_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    """A Tokenizer with Qwen2's normalizer, pre-tokenizer, decoder and post-processor around BPE(vocab, merges)."""
    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _added_tokens(config: dict[str, Any], path: Path) -> list[tuple[int, AddedToken]]:
    """(id, token) of tokenizer_config.json's added_tokens_decoder, by id."""
    table = config.get("added_tokens_decoder", {})
    if not isinstance(table, dict):
        raise LoadError(f"{path}: added_tokens_decoder must be an object of id -> token")
    found = []
    for key, entry in table.items():
        if not (str(key).isdigit() and isinstance(entry, dict) and isinstance(entry.get("content"), str)):
            raise LoadError(f"{path}: added_tokens_decoder[{key!r}] is not an id -> {{content, ...}} entry")
        special = bool(entry.get("special", False))
        token = AddedToken(
            entry["content"],
            single_word=bool(entry.get("single_word", False)),
            lstrip=bool(entry.get("lstrip", False)),
            rstrip=bool(entry.get("rstrip", False)),
            normalized=bool(entry.get("normalized", not special)),
            special=special,
        )
        found.append((int(key), token))
    return sorted(found, key=lambda item: item[0])


def _from_vocab_and_merges(directory: Path) -> Tokenizer:
    vocab_path, merges_path = directory / "vocab.json", directory / "merges.txt"
    try:
        vocab, merges = BPE.read_file(str(vocab_path), str(merges_path))
    except Exception as err:  # the Rust side raises a bare Exception for malformed files
        raise LoadError(f"{directory}: unreadable vocab.json / merges.txt ({err})") from err
    tokenizer = qwen2_bpe_tokenizer(vocab, merges)
    config_path = directory / "tokenizer_config.json"
    config = read_json(config_path) if config_path.is_file() else {}
    for token_id, token in _added_tokens(config, config_path):
        if token.special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
        if tokenizer.token_to_id(token.content) != token_id:
            raise LoadError(
                f"{config_path}: added token {token.content!r} should have id {token_id}, got "
                f"{tokenizer.token_to_id(token.content)} (the added ids must follow the vocabulary's)"
            )
    return tokenizer


class QwenTokenizer:
    """Qwen2's tokenizer: text -> token ids, without padding (each prompt is encoded alone)."""

    def __init__(self, tokenizer: Tokenizer, *, source: Path | None = None) -> None:
        # Settings stored in tokenizer.json must not cut or pad behind encode()'s back.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.tokenizer = tokenizer
        self.source = source

    @classmethod
    def from_dir(cls, directory: Path | str) -> QwenTokenizer:
        """tokenizer.json when present, else vocab.json + merges.txt (+ tokenizer_config.json's added tokens)."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if path.is_file():
            try:
                return cls(Tokenizer.from_file(str(path)), source=directory)
            except Exception as err:  # the Rust side raises a bare Exception for malformed files
                raise LoadError(f"{path}: not a readable tokenizer.json ({err})") from err
        if (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
            return cls(_from_vocab_and_merges(directory), source=directory)
        raise LoadError(f"{directory}: no tokenizer.json, nor vocab.json + merges.txt (a Qwen2 tokenizer)")

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can emit, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, max_length: int | None = None) -> list[int]:
        """The ids of `text`, the first max_length of them when given (transformers' truncation=True)."""
        if not isinstance(text, str):
            raise ValidationError(f"text must be a string, got {type(text).__name__}")
        ids = self.tokenizer.encode(text).ids
        return ids if max_length is None else ids[:max_length]

    def count(self, text: str) -> int:
        """How many ids `text` encodes to."""
        return len(self.encode(text))
