"""Qwen-Image-2.1's transformer against diffusers' QwenImage21Transformer2DModel (tiny random config, fp32),
and its block-causal segment metadata against the dense block-causal mask.

Tolerances: fp32 throughout; the only differences from diffusers are summation orders (packed GEMMs vs
its padded ones, one varlen attention call vs its per-segment SDPA calls), ~1e-7 relative per op, so
1e-5 absolute on O(1) outputs bounds them with margin. The cached path runs the same ops as the
uncached one on fewer rows: 1e-6.
"""

from __future__ import annotations

import random

import pytest
import torch

from mmgen.attention.impls import FlashAttentionImpl, SDPAImpl
from mmgen.attention.segments import SegmentMetadata, segment_attention
from mmgen.errors import ValidationError
from mmgen.loading.qwen_image21 import load_qwen_image21_transformer
from mmgen.models.qwen_image21 import PrefixCache, QwenImage21Config, QwenImage21Transformer
from mmgen.models.qwen_image21_layout import BlockCausalLayout
from tests.qwen_image21_cases import (
    TINY_TRANSFORMER,
    block_layout,
    diffusers_inputs,
    run_diffusers,
    run_mmgen,
    tiny_transformer,
)

IMPLS = {"sdpa": SDPAImpl(), "flash": FlashAttentionImpl("reference")}
# FlashAttention's route for a provider without seqused_q/k (FA2): rows and keys gathered per call.
PACKED = FlashAttentionImpl("reference")
PACKED.kernel.has_seqused_k = False
T2I = ([7], [], [(1, 4, 6)])
EDIT = ([11], [(2, 2)], [(1, 2, 4), (1, 4, 4)])
# Two condition images whose slots touch: they must stay two blocks (not attend each other both ways).
TWO_IMAGES = ([12], [(1, 4)], [(1, 2, 4), (1, 2, 4), (1, 2, 6)])


@pytest.fixture(scope="module")
def models():
    reference = tiny_transformer(seed=3)
    ours = QwenImage21Transformer(QwenImage21Config(**TINY_TRANSFORMER))
    ours.load_state_dict(reference.state_dict())
    return reference, ours.eval()


def _ours(model, inputs, grids, impl, **kwargs):
    """mmgen's prediction [B, N, C] through IMPLS[impl] (qwen_image21_cases.run_mmgen)."""
    return run_mmgen(model, inputs, grids, IMPLS[impl], **kwargs)


def _cached_step(model, inputs, layout, impl, cache):
    """A cached step: the target tokens only, against the filled PrefixCache."""
    with torch.no_grad():
        return model(
            inputs["hidden_states"],
            inputs["timestep"],
            None,
            metadata=layout,
            attention=IMPLS[impl],
            cache=cache,
        )


def test_state_dict_keys_are_diffusers(models):
    reference, ours = models
    assert set(ours.state_dict()) == set(reference.state_dict())


def test_released_config_is_7_12b():
    with torch.device("meta"):
        model = QwenImage21Transformer(QwenImage21Config())
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 7.12


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("case", [T2I, EDIT, TWO_IMAGES], ids=["t2i", "edit", "two_images"])
def test_matches_diffusers(models, impl, case):
    reference, ours = models
    text_lens, slot_runs, grids = case
    inputs = diffusers_inputs(text_lens, slot_runs, grids, seed=5)
    expected = run_diffusers(reference, inputs)
    got = _ours(ours, inputs, grids, impl)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_prompts_of_different_lengths_packed(models, impl):
    """Two prompts of 5 and 9 tokens in one packed call equal each prompt alone in diffusers."""
    reference, ours = models
    grids = [(1, 2, 4), (1, 4, 4)]
    batch = diffusers_inputs([9, 5], [(2, 2)], grids, seed=8)
    got = _ours(ours, batch, grids, impl)
    for b, length in enumerate([9, 5]):
        alone = {
            **batch,
            **{k: batch[k][b : b + 1] for k in ("hidden_states", "timestep")},
            "encoder_hidden_states": batch["encoder_hidden_states"][b : b + 1, :length],
            "img_mask": torch.cat(
                [batch["slots"][b : b + 1, :length], torch.ones(1, 4, dtype=torch.bool)], 1
            ),
            "img_shapes": batch["img_shapes"][:1],
            "encoder_hidden_states_mask": None,
        }
        torch.testing.assert_close(got[b : b + 1], run_diffusers(reference, alone), rtol=0, atol=1e-5)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("case", [T2I, EDIT], ids=["t2i", "edit"])
def test_cached_prefix_matches_uncached_and_diffusers(models, impl, case):
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    reference, ours = models
    text_lens, slot_runs, grids = case
    first = diffusers_inputs(text_lens, slot_runs, grids, seed=11)
    later = {
        **diffusers_inputs(text_lens, slot_runs, grids, seed=12),
        "encoder_hidden_states": first["encoder_hidden_states"],
    }
    later["hidden_states"][:, : -grids[-1][1] * grids[-1][2]] = first["hidden_states"][
        :, : -grids[-1][1] * grids[-1][2]
    ]
    kv = QwenImage21KVCache(TINY_TRANSFORMER["num_layers"])
    expected_first = run_diffusers(reference, first, kv_cache=kv, kv_cache_mode="extract")
    expected_later = run_diffusers(reference, later, kv_cache=kv, kv_cache_mode="cached")

    layout = block_layout(first, grids)
    cache = PrefixCache()
    prefill = _ours(ours, first, grids, impl, layout=layout, cache=cache)
    uncached = _ours(ours, later, grids, impl, layout=layout)
    cached = _cached_step(ours, later, layout, impl, cache)
    torch.testing.assert_close(cached, uncached, rtol=0, atol=1e-6)
    torch.testing.assert_close(prefill, expected_first, rtol=0, atol=1e-5)
    torch.testing.assert_close(cached, expected_later, rtol=0, atol=1e-5)
    # Only the target rows of the cache were rewritten: a second cached step gives the same result.
    again = _cached_step(ours, later, layout, impl, cache)
    torch.testing.assert_close(again, cached, rtol=0, atol=0)


def test_loads_a_diffusers_directory(models, tmp_path):
    reference, ours = models
    reference.save_pretrained(tmp_path / "transformer")
    loaded = load_qwen_image21_transformer(tmp_path / "transformer", dtype=torch.float32)
    inputs = diffusers_inputs(*T2I[:2], T2I[2], seed=2)
    torch.testing.assert_close(_ours(loaded, inputs, T2I[2], "sdpa"), _ours(ours, inputs, T2I[2], "sdpa"))


def test_bad_inputs_are_named(models):
    _, ours = models
    inputs = diffusers_inputs(*T2I[:2], T2I[2], seed=2)
    with pytest.raises(ValidationError, match="slots"):
        BlockCausalLayout.build([7], [(1, 2, 2), (1, 4, 6)], text_width=7)
    with pytest.raises(ValidationError, match="text"):
        _ours(
            ours,
            {**inputs, "encoder_hidden_states": inputs["encoder_hidden_states"][:, :3]},
            T2I[2],
            "sdpa",
            layout=block_layout(inputs, T2I[2]),
        )
    with pytest.raises(ValidationError, match="unknown keys"):
        QwenImage21Config.from_diffusers({"num_layers": 2, "guidance_embeds": True})


# ---------------------------------------------------------------------------------------------------
# The block-causal metadata against the dense mask


def _dense_block_causal(samples):
    """bool [T, T] from diffusers' rule per sample, (q >= k) or same image block, block-diagonal over samples.
    samples: per sample a list of image-block ids per token (-1 for text)."""
    total = sum(len(s) for s in samples)
    mask = torch.zeros(total, total, dtype=torch.bool)
    offset = 0
    for ids in samples:
        ids = torch.tensor(ids)
        n = len(ids)
        index = torch.arange(n)
        same_block = (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
        mask[offset : offset + n, offset : offset + n] = (index[:, None] >= index[None, :]) | same_block
        offset += n
    return mask


def _random_case(rng):
    """Random text lengths, slot runs and grids of two-to-three samples sharing an image layout."""
    images = [(1, 2 * rng.randint(1, 2), 2 * rng.randint(1, 3)) for _ in range(rng.randint(0, 2))]
    target = (1, 2 * rng.randint(1, 3), 2 * rng.randint(1, 2))
    lead = rng.randint(0, 3)
    slots_per_image = [h * w // 4 for _, h, w in images]
    gaps = [rng.randint(0, 2) for _ in images]
    prefix = lead + sum(slots_per_image) + sum(gaps)
    text_lens = [prefix + rng.randint(1, 6) for _ in range(rng.randint(2, 3))]
    width = max(text_lens)
    slots = torch.zeros(len(text_lens), width, dtype=torch.bool)
    ids = [[] for _ in text_lens]
    for b, length in enumerate(text_lens):
        column = lead
        ids[b] += [-1] * lead
        for index, (count, gap) in enumerate(zip(slots_per_image, gaps, strict=True)):
            slots[b, column : column + count] = True
            ids[b] += [index] * (4 * count) + [-1] * gap
            column += count + gap
        ids[b] += [-1] * (length - column) + [len(images)] * (target[1] * target[2])
    return text_lens, slots, [*images, target], ids


@pytest.mark.parametrize("seed", range(6))
def test_segments_equal_the_dense_block_causal_mask(seed):
    rng = random.Random(seed)
    text_lens, slots, grids, ids = _random_case(rng)
    layout = BlockCausalLayout.build(text_lens, grids, text_width=slots.shape[1], slot_masks=slots)
    assert torch.equal(layout.prefill.allowed_keys, _dense_block_causal(ids))


@pytest.mark.parametrize("seed", range(4))
def test_segment_attention_equals_dense_masked_and_reads_no_other_key(seed):
    rng = random.Random(seed)
    text_lens, slots, grids, ids = _random_case(rng)
    meta = BlockCausalLayout.build(text_lens, grids, text_width=slots.shape[1], slot_masks=slots).prefill
    mask = _dense_block_causal(ids)
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(meta.total_q, 2, 8, generator=generator) for _ in range(3))
    scores = torch.einsum("qhd,khd->hqk", q, k) * 8**-0.5
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
    # Keys of the later half only, so the earlier rows (the first sample, causal text) read none of them.
    touched = (torch.rand(meta.total_k, generator=generator) < 0.3) & (
        torch.arange(meta.total_k) >= meta.total_k // 2
    )
    touched[-1] = True
    k2, v2 = k.clone(), v.clone()
    k2[touched] = 1e3 * torch.randn(int(touched.sum()), 2, 8, generator=generator)
    v2[touched] = 1e3 * torch.randn(int(touched.sum()), 2, 8, generator=generator)
    untouched_rows = ~(mask & touched[None, :]).any(dim=1)
    assert untouched_rows.any()
    for impl in (*IMPLS.values(), PACKED):
        out = segment_attention(impl, q, k, v, meta)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
        perturbed = segment_attention(impl, q, k2, v2, meta)
        torch.testing.assert_close(perturbed[untouched_rows], out[untouched_rows], rtol=0, atol=1e-6)


def test_text_runs_are_causal_segments_and_image_blocks_bidirectional():
    """An edit prompt [lead text, condition image slots, text] + target: per sample two causal text runs
    and two image blocks, in two kernel calls (image blocks first, each reading up to its own end)."""
    slots = torch.zeros(2, 9, dtype=torch.bool)
    slots[:, 2:4] = True  # 2 slots = one 2x4 condition image (8 tokens)
    layout = BlockCausalLayout.build([9, 7], [(1, 2, 4), (1, 2, 2)], text_width=9, slot_masks=slots)
    blocks, text = layout.prefill.calls
    # sample 0: text [0, 2), image [2, 10), text [10, 15), target [15, 19); sample 1: [19, 36)
    assert not blocks.causal and text.causal
    assert blocks.cu_seqlens_q.tolist() == [2, 15, 21, 32, 36] and blocks.seqused_q.tolist() == [8, 4, 8, 4]
    assert blocks.cu_seqlens_k.tolist() == [0, 0, 19, 19, 36] and blocks.seqused_k.tolist() == [
        10,
        19,
        10,
        17,
    ]
    assert text.cu_seqlens_q.tolist() == [0, 10, 19, 29, 36] and text.seqused_q.tolist() == [2, 5, 2, 3]
    assert text.seqused_k.tolist() == [2, 15, 2, 13]
    assert text.rows.tolist() == [0, 1, 10, 11, 12, 13, 14, 19, 20, 29, 30, 31]
    assert layout.prefill.pairs == int(layout.prefill.allowed_keys.sum())


def test_segment_metadata_rejects_a_causal_segment_with_fewer_keys_than_queries():
    with pytest.raises(ValidationError, match="causal"):
        SegmentMetadata.build([3], [0], [2], 4, causal=[True])


def test_cached_segments_read_prefix_and_own_target():
    layout = BlockCausalLayout.build([5, 3], [(1, 2, 2)], text_width=5)
    cached = layout.cached
    (call,) = cached.calls
    assert call.cu_seqlens_q.tolist() == [0, 4, 8] and call.seqused_q is None and not call.causal
    assert call.cu_seqlens_k.tolist() == [0, 9, 16]
    assert call.seqused_k.tolist() == [9, 7]
    assert cached.pairs == 4 * 9 + 4 * 7
    assert layout.target_rows.tolist() == [5, 6, 7, 8, 12, 13, 14, 15]


def test_segment_metadata_rejects_keys_outside_the_buffer():
    with pytest.raises(ValidationError, match="outside"):
        SegmentMetadata.build([2], [0], [5], 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["flash", "sdpa"])
def test_cuda_segment_attention_bf16(backend):
    """The GPU kernels read segments (repeated key starts, seqused_k) as the reference does."""
    from mmgen.attention import select_attention

    layout = BlockCausalLayout.build([200, 37], [(1, 32, 32)], text_width=200, device="cuda")
    slots = torch.zeros(2, 300, dtype=torch.bool)
    slots[:, 5:261] = True  # a 32x32 condition image between two text runs
    edit = BlockCausalLayout.build(
        [300, 280], [(1, 32, 32), (1, 32, 32)], text_width=300, slot_masks=slots, device="cuda"
    )
    generator = torch.Generator("cuda").manual_seed(0)
    for meta in (layout.prefill, layout.cached, edit.prefill, edit.cached):
        q = torch.randn(meta.total_q, 4, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
        k, v = (
            torch.randn(meta.total_k, 4, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
            for _ in range(2)
        )
        impl = select_attention(backend, device="cuda", dtype=torch.bfloat16, head_dim=128)
        expected = segment_attention(IMPLS["flash"], q.float(), k.float(), v.float(), meta)
        got = segment_attention(impl, q, k, v, meta)
        torch.testing.assert_close(got.float(), expected, rtol=0, atol=2e-2)


def test_bf16_is_as_close_to_fp32_as_diffusers_bf16(models, tmp_path):
    """In bf16 (diffusers loaded as from_pretrained makes it: its tables stay fp32) mmgen differs from
    diffusers by bf16 roundings only: no farther from the fp32 result than diffusers' bf16 is."""
    from diffusers import QwenImage21Transformer2DModel

    reference, ours = models
    reference.save_pretrained(tmp_path)
    reference16 = QwenImage21Transformer2DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16).eval()
    ours16 = QwenImage21Transformer(ours.config)
    ours16.load_state_dict(ours.state_dict())
    ours16 = ours16.to(torch.bfloat16).eval()
    text_lens, slot_runs, grids = EDIT
    inputs = diffusers_inputs(text_lens, slot_runs, grids, seed=5)
    expected = run_diffusers(reference, inputs)
    inputs16 = {
        k: v.bfloat16() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()
    }
    theirs = run_diffusers(reference16, inputs16).float()
    got = _ours(ours16, inputs16, grids, "sdpa").float()
    assert (got - theirs).abs().max() <= 2**-6 * theirs.abs().max()
    assert (got - expected).abs().max() <= 1.25 * (theirs - expected).abs().max()


def test_without_causal_condition_matches_diffusers():
    """causal_condition=False: every token modulated at its sample's own timestep (no cache allowed)."""
    from diffusers import QwenImage21Transformer2DModel

    from tests.qwen_image21_cases import randomize

    torch.manual_seed(0)
    reference = randomize(
        QwenImage21Transformer2DModel(**TINY_TRANSFORMER, causal_condition=False), seed=9
    ).eval()
    ours = QwenImage21Transformer(QwenImage21Config(**TINY_TRANSFORMER, causal_condition=False))
    ours.load_state_dict(reference.state_dict())
    text_lens, slot_runs, grids = EDIT
    inputs = diffusers_inputs(text_lens, slot_runs, grids, seed=4)
    torch.testing.assert_close(
        _ours(ours.eval(), inputs, grids, "sdpa"), run_diffusers(reference, inputs), rtol=0, atol=1e-5
    )
    with pytest.raises(ValidationError, match="causal_condition"):
        _ours(ours, inputs, grids, "sdpa", cache=PrefixCache())


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_row_kernel_formulas_match_diffusers_with_and_without_cache(models, impl):
    """The fused path's formulas (on CPU: the row kernels' torch references), prefill and cached step."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    reference, ours = models
    text_lens, slot_runs, grids = EDIT
    first = diffusers_inputs(text_lens, slot_runs, grids, seed=21)
    later = {**first, "hidden_states": first["hidden_states"].clone(), "timestep": first["timestep"] * 0.5}
    target = grids[-1][1] * grids[-1][2]
    later["hidden_states"][:, -target:] = torch.randn(1, target, first["hidden_states"].shape[-1])
    kv = QwenImage21KVCache(TINY_TRANSFORMER["num_layers"])
    expected_first = run_diffusers(reference, first, kv_cache=kv, kv_cache_mode="extract")
    expected_later = run_diffusers(reference, later, kv_cache=kv, kv_cache_mode="cached")
    layout = block_layout(first, grids)
    ours.set_row_kernels("on")
    try:
        cache = PrefixCache()
        prefill = _ours(ours, first, grids, impl, layout=layout, cache=cache)
        cached = _cached_step(ours, later, layout, impl, cache)
    finally:
        ours.set_row_kernels("auto")
    torch.testing.assert_close(prefill, expected_first, rtol=0, atol=1e-5)
    torch.testing.assert_close(cached, expected_later, rtol=0, atol=1e-5)
    with pytest.raises(ValidationError, match="row kernels"):
        ours.set_row_kernels("fast")


def _row_kernel_modes(models, device, dtype):
    """{mode: (prefill, cached step)} of the tiny model in `dtype` on `device`, row kernels on and off."""
    _, ours = models
    model = QwenImage21Transformer(ours.config)
    model.load_state_dict(ours.state_dict())
    model = model.to(device, dtype).eval()
    text_lens, slot_runs, grids = EDIT
    inputs = diffusers_inputs(text_lens, slot_runs, grids, seed=2)
    moved = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    moved.update({k: moved[k].to(dtype) for k in ("hidden_states", "encoder_hidden_states", "timestep")})
    layout = BlockCausalLayout.build(
        text_lens, grids, text_width=inputs["slots"].shape[1], slot_masks=inputs["slots"], device=device
    )
    impl = SDPAImpl()
    results = {}
    for mode in ("on", "off"):
        model.set_row_kernels(mode)
        with torch.no_grad():
            args, cache = (moved["hidden_states"], moved["timestep"]), PrefixCache()
            prefill = model(
                *args, moved["encoder_hidden_states"], metadata=layout, attention=impl, cache=cache
            )
            cached = model(*args, None, metadata=layout, attention=impl, cache=cache)
        results[mode] = (prefill.float(), cached.float())
    return results


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_row_kernels_close_to_the_op_by_op_path(models):
    """On CUDA the Triton row kernels and silu(gate) * up run (bf16): within bf16 roundings of the
    op-by-op path, cache included."""
    results = _row_kernel_modes(models, "cuda", torch.bfloat16)
    for fused, plain in zip(results["on"], results["off"], strict=True):
        assert (fused - plain).abs().max() <= 2**-5 * plain.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_row_kernel_path_close_to_the_op_by_op_path(models, dtype):
    """The row-kernel path in bf16 and fp16 on the CPU (its torch references; fp16 clips the residual
    between the blocks' last add and the next norm, so there each block makes its own attention input):
    within half-precision roundings of the op-by-op path, cache included."""
    results = _row_kernel_modes(models, "cpu", dtype)
    for fused, plain in zip(results["on"], results["off"], strict=True):
        assert (fused - plain).abs().max() <= 2**-5 * plain.abs().max()


def test_call_contract_builds_the_layout_and_refuses_what_it_does_not_run(models):
    """The DiT call contract: without metadata the layout comes from text_lens/grids/slot_masks; giving
    both, chunked or FP8 settings and sequence parallelism are refused by name."""
    from mmgen.models.settings import ExecutionSettings

    _, ours = models
    text_lens, slot_runs, grids = EDIT
    inputs = diffusers_inputs(text_lens, slot_runs, grids, seed=3)
    args = (inputs["hidden_states"], inputs["timestep"], inputs["encoder_hidden_states"])
    with torch.no_grad():
        built = ours(
            *args, attention=SDPAImpl(), text_lens=text_lens, grids=grids, slot_masks=inputs["slots"]
        )
    torch.testing.assert_close(built, _ours(ours, inputs, grids, "sdpa"), rtol=0, atol=0)
    with pytest.raises(ValidationError, match="metadata"):
        ours(*args, attention=SDPAImpl(), metadata=block_layout(inputs, grids), text_lens=text_lens)
    with pytest.raises(ValidationError, match="ffn_chunk"):
        _ours(ours, inputs, grids, "sdpa", settings=ExecutionSettings(ffn_chunk=4))
