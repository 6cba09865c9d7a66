"""T5Gemma on the paged-KV runtime vs transformers' T5GemmaForConditionalGeneration (tiny random config).

Also home of `build_tiny_t5gemma`, the checkpoint builder the other test_llm_* files import.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import T5GemmaConfig as HFT5GemmaConfig
from transformers import T5GemmaForConditionalGeneration as HFT5Gemma

from mmgen.errors import LoadError
from mmgen.llm.backends import make_backend
from mmgen.llm.forward_batch import ForwardBatch, ForwardMode
from mmgen.llm.memory import KVPool, PageAllocator, ReqToTokenPool, RequestMemory
from mmgen.llm.models.t5gemma_loading import load_t5gemma

WINDOW = 4


def tiny_hf_config(*, tie: bool = True, window: int = WINDOW) -> HFT5GemmaConfig:
    """vocab 128, hidden 32, 2 + 2 layers (sliding then global), 4 q / 2 kv heads of 8, softcaps on."""
    stack = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=window,
        attn_logit_softcapping=20.0,
        final_logit_softcapping=15.0,
        query_pre_attn_scalar=16,
        rms_norm_eps=1e-6,
    )
    return HFT5GemmaConfig(
        encoder=dict(stack),
        decoder=dict(stack),
        vocab_size=128,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )


def build_tiny_t5gemma(directory: Path, *, tie: bool = True, seed: int = 0) -> HFT5Gemma:
    """Save a tiny random T5Gemma (weights re-drawn so tokens and logits vary) to directory; return it."""
    torch.manual_seed(seed)
    model = HFT5Gemma(tiny_hf_config(tie=tie)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = 0.3 / 32**0.5 if "embed" in name else (0.1 if "norm" in name else 0.3)
            param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.generation_config.eos_token_id = None  # references run max_new_tokens steps, no early stop
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("t5gemma")
    return build_tiny_t5gemma(directory), directory


def _extend_batch(memory, rows, enc_lens, prefix_lens, ext_lens):
    """An EXTEND ForwardBatch: request i writes ext_lens[i] decoder tokens after prefix_lens[i]."""
    table = memory.req_pool.req_to_token
    loc = torch.cat(
        [
            table[r, e + p : e + p + n]
            for r, e, p, n in zip(rows, enc_lens, prefix_lens, ext_lens, strict=True)
        ]
    )
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, ext_lens, strict=True)])
    ext = torch.tensor(ext_lens, dtype=torch.int32)
    pre = torch.tensor(prefix_lens, dtype=torch.int32)
    enc = torch.tensor(enc_lens, dtype=torch.int32)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(rows),
        req_pool_indices=torch.tensor(rows),
        seq_lens=pre + ext,
        seq_lens_cpu=pre + ext,
        out_cache_loc=loc.long(),
        positions=positions,
        extend_seq_lens=ext,
        extend_seq_lens_cpu=ext,
        extend_prefix_lens=pre,
        extend_prefix_lens_cpu=pre,
        encoder_lens=enc,
        encoder_lens_cpu=enc,
    )


@pytest.mark.parametrize("page_size", [1, 16])
def test_teacher_forced_logits_match_transformers(tiny, page_size):
    """Multi-token EXTEND (prefix 0, then a cached prefix longer than the window) = HF forward logits."""
    hf, directory = tiny
    model = load_t5gemma(directory).model
    gen = torch.Generator().manual_seed(page_size)
    enc_lens, dec_lens = [9, 3, 14], [11, 7, 9]
    prompts = [torch.randint(3, 128, (n,), generator=gen) for n in enc_lens]
    dec_ids = [torch.randint(3, 128, (n,), generator=gen) for n in dec_lens]
    memory = RequestMemory(ReqToTokenPool(4, 64), PageAllocator(64, page_size))
    kv = KVPool(2, 64, page_size, 2, 8, torch.float32)
    backend = make_backend("torch_native", memory.req_pool, kv)
    rows = [memory.allocate(e, d).row for e, d in zip(enc_lens, dec_lens, strict=True)]
    with torch.inference_mode():
        cu = torch.tensor([0, *torch.tensor(enc_lens).cumsum(0).tolist()], dtype=torch.int32)
        positions = torch.cat([torch.arange(n) for n in enc_lens])
        hidden_enc = model.encode(torch.cat(prompts), positions, cu, max(enc_lens))
        table = memory.req_pool.req_to_token
        model.write_cross_kv(
            hidden_enc, torch.cat([table[r, :e] for r, e in zip(rows, enc_lens, strict=True)]).long(), backend
        )
        # Two steps: the first 5 (or fewer) decoder tokens, then the rest on top of the cached prefix.
        first = [min(5, n) for n in dec_lens]
        logits = [[] for _ in rows]
        for prefix, ext in (
            (([0] * 3), first),
            (first, [n - f for n, f in zip(dec_lens, first, strict=True)]),
        ):
            batch = _extend_batch(memory, rows, enc_lens, prefix, ext)
            backend.init_forward_metadata(batch)
            tokens = torch.cat([d[p : p + n] for d, p, n in zip(dec_ids, prefix, ext, strict=True)])
            out = model.compute_logits(model.decode(tokens, batch.positions, batch, backend))
            for i, chunk in enumerate(out.split(ext)):
                logits[i].append(chunk)
        for i in range(3):
            ref = hf(input_ids=prompts[i][None], decoder_input_ids=dec_ids[i][None]).logits[0]
            torch.testing.assert_close(torch.cat(logits[i]), ref, atol=1e-4, rtol=0)


def test_untied_lm_head_loads_and_matches(tmp_path):
    hf = build_tiny_t5gemma(tmp_path, tie=False, seed=3)
    loaded = load_t5gemma(tmp_path)
    assert loaded.model.lm_head is not None
    torch.testing.assert_close(loaded.model.lm_head.out_proj.weight, hf.lm_head.out_proj.weight)
    hidden = torch.randn(5, 32)
    with torch.no_grad():
        ref = torch.tanh(hf.lm_head(hidden) / 15.0) * 15.0
    torch.testing.assert_close(loaded.model.compute_logits(hidden), ref, atol=1e-5, rtol=0)


def test_config_and_generation_ids(tiny):
    _, directory = tiny
    loaded = load_t5gemma(directory)
    cfg = loaded.config
    assert cfg.decoder_start_token_id == 2 and cfg.eos_token_ids == (1,)
    assert cfg.decoder.layer_types == ("sliding_attention", "full_attention")
    assert cfg.decoder.sliding_window == WINDOW and cfg.encoder.attn_logit_softcapping == 20.0
    assert loaded.tokenizer is None  # no tokenizer.json in this directory


def test_load_errors_name_the_problem(tiny, tmp_path):
    _, directory = tiny
    with pytest.raises(LoadError, match="model directory not found"):
        load_t5gemma(tmp_path / "nope")
    # A checkpoint missing one tensor.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((directory / "config.json").read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.decoder.layers.1.cross_attn.k_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(LoadError, match="cross_attn.k_proj.weight"):
        load_t5gemma(broken)
    # A config of another architecture.
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = "t5"
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match="model_type='t5'"):
        load_t5gemma(broken)
