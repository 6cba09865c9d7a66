"""The Qwen-Image transformer against diffusers' QwenImageTransformer2DModel, and its packed joint attention.

Tiny random configs on CPU in float32. diffusers pads a batch's prompts to the longest and masks the
padding densely; mmgen gets each prompt's length and attends varlen rows of [image, text_b] tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from mmgen.attention.impls import FlashAttentionImpl, SDPAImpl
from mmgen.attention.metadata import AttentionMetadata
from mmgen.errors import ValidationError
from mmgen.models.qwen_image import QwenImageConfig, QwenImageTransformer, true_cfg_combine
from mmgen.models.qwen_image_blocks import joint_attend, qwen_rope
from mmgen.models.qwen_image_joint import JointTokens, joint_attention_metadata
from mmgen.models.settings import ExecutionSettings
from mmgen.parallel.layout import ParallelLayout

TINY = {
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 24,
    "num_attention_heads": 2,
    "joint_attention_dim": 20,
    "axes_dims_rope": (4, 10, 10),
}
IMPLS = {"sdpa": SDPAImpl, "flash-reference": lambda: FlashAttentionImpl("reference")}
TOL = 1e-5


@pytest.fixture(scope="module")
def models():
    """(diffusers model, mmgen model) with the same random weights, float32, eval."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    reference = diffusers.QwenImageTransformer2DModel(**TINY).eval()
    generator = torch.Generator().manual_seed(1)
    state = {name: _random_like(name, value, generator) for name, value in reference.state_dict().items()}
    reference.load_state_dict(state)
    ours = QwenImageTransformer(QwenImageConfig(**TINY)).eval()
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def _random_like(name: str, value: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Weights that keep activations O(1) (so 1e-5 is a tight bound), norms near 1, biases small."""
    noise = torch.randn(value.shape, generator=generator)
    if "norm" in name:
        return 1.0 + 0.1 * noise
    return noise * value.shape[1] ** -0.5 if value.dim() == 2 else 0.1 * noise


def _inputs(batch: int, grid: tuple[int, int, int], text_len: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    tokens = grid[0] * grid[1] * grid[2]
    latents = torch.randn(batch, tokens, TINY["in_channels"], generator=generator)
    text = torch.randn(batch, text_len, TINY["joint_attention_dim"], generator=generator)
    timestep = torch.rand(batch, generator=generator)
    return latents, timestep, text


def _diffusers(reference, latents, timestep, text, grid, mask=None):
    with torch.no_grad():
        return reference(
            hidden_states=latents,
            encoder_hidden_states=text,
            encoder_hidden_states_mask=mask,
            timestep=timestep,
            img_shapes=[[grid]] * latents.shape[0],  # as QwenImagePipeline passes them
            return_dict=False,
        )[0]


def _ours(model, latents, timestep, text, grid, impl, text_lens=None):
    with torch.no_grad():
        return model(latents, timestep, text, grids=(grid,), attention=IMPLS[impl](), text_lens=text_lens)


# Odd heights and widths (the centered positions split -(n - n // 2) .. n // 2 - 1: an odd side has
# one more negative position), odd and even in each axis, several frames, and the two grids of an edit
# (the text starts after the larger grid's half side).
ROPE_GRIDS = [
    [(1, 1, 1)],
    [(1, 3, 5)],
    [(1, 5, 3)],
    [(1, 7, 7)],
    [(1, 4, 6)],
    [(1, 6, 9)],
    [(3, 5, 4)],
    [(1, 4, 4), (1, 5, 7)],
    [(1, 9, 2), (1, 3, 3)],
]


@pytest.mark.parametrize("grids", ROPE_GRIDS, ids=str)
def test_rope_tables_equal_diffusers_on_odd_and_even_grids(grids):
    diffusers_qwen = pytest.importorskip("diffusers.models.transformers.transformer_qwenimage")
    axes, text_width = (16, 56, 56), 6  # the released model's axes
    reference = diffusers_qwen.QwenEmbedRope(theta=10000, axes_dim=list(axes), scale_rope=True)
    image, text = reference([grids], device=torch.device("cpu"), max_txt_seq_len=text_width)
    ours = qwen_rope(grids, text_width, axes)
    assert ours.image_freqs.shape == (1, *image.shape[:1], 1, image.shape[1])
    # the same float32 ops as diffusers' tables; 1e-6 leaves room for another CPU's sin/cos rounding
    torch.testing.assert_close(ours.image_freqs[0, :, 0], image, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.text_freqs[0, :, 0], text, rtol=0, atol=1e-6)


def test_state_dict_keys_are_diffusers(models):
    reference, ours = models
    assert sorted(ours.state_dict()) == sorted(reference.state_dict())


def test_released_config_has_diffusers_shapes():
    """Qwen-Image's own config (the defaults), built on the meta device: every tensor of diffusers'
    model with its shape (20.4B parameters)."""
    diffusers = pytest.importorskip("diffusers")
    with torch.device("meta"):
        reference = diffusers.QwenImageTransformer2DModel()
        ours = QwenImageTransformer(QwenImageConfig())
    shapes = {name: tuple(value.shape) for name, value in ours.state_dict().items()}
    assert shapes == {name: tuple(value.shape) for name, value in reference.state_dict().items()}
    assert round(sum(p.numel() for p in ours.parameters()) / 1e9, 1) == 20.4


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_one_prompt_matches_diffusers(models, impl):
    reference, ours = models
    grid = (1, 4, 4)
    latents, timestep, text = _inputs(1, grid, 7, seed=2)
    expected = _diffusers(reference, latents, timestep, text, grid)
    got = _ours(ours, latents, timestep, text, grid, impl)
    assert got.shape == (1, 16, TINY["patch_size"] ** 2 * TINY["out_channels"])
    assert (got - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("grid", [(1, 4, 4), (1, 3, 5)])
def test_two_prompts_of_different_lengths_match_diffusers_masked(models, impl, grid):
    """One packed call (cond and uncond of lengths 9 and 5) == diffusers' padded + masked call, and ==
    diffusers' unpadded per-prompt calls (what its pipeline does for true CFG)."""
    reference, ours = models
    lens = [9, 5]
    latents, timestep, text = _inputs(2, grid, max(lens), seed=3)
    latents[1] = latents[0]  # true CFG: the same latents and timestep, two prompts
    timestep[1] = timestep[0]
    mask = torch.zeros(2, max(lens), dtype=torch.long)
    for row, length in enumerate(lens):
        text[row, length:] = 0  # zero padding, as QwenImagePipeline pads
        mask[row, :length] = 1
    expected = _diffusers(reference, latents, timestep, text, grid, mask)
    got = _ours(ours, latents, timestep, text, grid, impl, text_lens=torch.tensor(lens))
    assert (got - expected).abs().max().item() <= TOL
    for row, length in enumerate(lens):
        alone = _diffusers(
            reference, latents[row : row + 1], timestep[row : row + 1], text[row : row + 1, :length], grid
        )
        assert (got[row : row + 1] - alone).abs().max().item() <= TOL


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_text_padding_is_never_read(models, impl):
    """Whatever the padded text rows hold, the output is bit-identical."""
    _, ours = models
    grid, lens = (1, 3, 5), [4, 8, 2]
    latents, timestep, text = _inputs(3, grid, max(lens), seed=4)
    for row, length in enumerate(lens):
        text[row, length:] = 0
    base = _ours(ours, latents, timestep, text, grid, impl, text_lens=lens)
    junk = text.clone()
    for row, length in enumerate(lens):
        junk[row, length:] = 1e3 * torch.randn(max(lens) - length, text.shape[-1])
    assert torch.equal(_ours(ours, latents, timestep, junk, grid, impl, text_lens=lens), base)


def test_prebuilt_layout_is_used_and_checked(models):
    _, ours = models
    grid, lens = (1, 3, 5), [4, 8]
    latents, timestep, text = _inputs(2, grid, max(lens), seed=9)
    layout = JointTokens.build(lens, 15, text_width=max(lens))
    with torch.no_grad():
        got = ours(latents, timestep, text, grids=(grid,), attention=SDPAImpl(), metadata=layout)
    assert torch.equal(got, _ours(ours, latents, timestep, text, grid, "sdpa", text_lens=lens))
    with pytest.raises(ValidationError, match="layout"):
        ours(latents, timestep, text[:, :5], grids=(grid,), attention=SDPAImpl(), metadata=layout)
    with pytest.raises(ValidationError, match="give one"):
        ours(latents, timestep, text, grids=(grid,), attention=SDPAImpl(), metadata=layout, text_lens=lens)
    with pytest.raises(ValidationError, match="grids"):
        ours(latents, timestep, text, grids=((1, 4, 4),), attention=SDPAImpl(), text_lens=lens)


def test_call_contract_settings_and_parallel(models):
    """The shared DiT call keywords: a block stream (settings) runs every block through it with the
    same output; settings and a parallel layout this model does not run raise, naming the field."""
    _, ours = models
    grid = (1, 3, 5)
    latents, timestep, text = _inputs(1, grid, 4, seed=3)

    def call(**keywords):
        return ours(latents, timestep, text, grids=(grid,), attention=SDPAImpl(), **keywords)

    streamed = []

    def stream(blocks):
        streamed.append(len(blocks))
        return iter(blocks)

    with torch.no_grad():
        assert torch.equal(call(settings=ExecutionSettings(block_stream=stream)), call())
    assert streamed == [TINY["num_layers"]]
    for settings, field in (
        (ExecutionSettings(ffn_chunk=8), "ffn_chunk"),
        (ExecutionSettings(block_chunk=8), "block_chunk"),
        (ExecutionSettings(fp8_attention=True), "fp8_attention"),
    ):
        with pytest.raises(ValidationError, match=field):
            call(settings=settings)
    with pytest.raises(ValidationError, match="parallel"):
        call(parallel=ParallelLayout(world_size=2, sp_degree=2))


def _dense_masked(image_qkv, text_qkv, lens):
    """diffusers' joint attention: rows [text padded to L, image], a boolean key mask; fp32 SDPA."""
    q, k, v = (torch.cat([t, i], dim=1).transpose(1, 2) for i, t in zip(image_qkv, text_qkv, strict=True))
    width = text_qkv[0].shape[1]
    keys = torch.ones(len(lens), k.shape[2], dtype=torch.bool, device=k.device)
    for row, length in enumerate(lens):
        keys[row, length:width] = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keys[:, None, None, :]).transpose(1, 2)
    return out[:, width:], out[:, :width]


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("seed", range(4))
def test_packed_joint_attention_equals_dense_masked(impl, seed):
    generator = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 5, (1,), generator=generator))
    width = int(torch.randint(2, 12, (1,), generator=generator))
    lens = torch.randint(1, width + 1, (batch,), generator=generator).tolist()
    image_tokens, heads, head_dim = int(torch.randint(1, 20, (1,), generator=generator)), 2, 16
    image_qkv = tuple(
        torch.randn(batch, image_tokens, heads, head_dim, generator=generator) for _ in range(3)
    )
    text_qkv = tuple(torch.randn(batch, width, heads, head_dim, generator=generator) for _ in range(3))
    layout = JointTokens.build(lens, image_tokens, text_width=width)
    text_out, image_out = joint_attend(IMPLS[impl](), text_qkv, image_qkv, layout)
    image_ref, text_ref = _dense_masked(image_qkv, text_qkv, lens)
    assert (image_out - image_ref).abs().max().item() <= TOL
    for row, length in enumerate(lens):
        assert (text_out[row, :length] - text_ref[row, :length]).abs().max().item() <= TOL
        assert not text_out[row, length:].any()  # padded queries: zeros, never computed into anything
    # Padding rows of q, k and v changed to junk: every valid output keeps its bits.
    junk = tuple(t.clone() for t in text_qkv)
    for t in junk:
        for row, length in enumerate(lens):
            t[row, length:] = 1e4 * torch.randn(width - length, heads, head_dim, generator=generator)
    text_junk, image_junk = joint_attend(IMPLS[impl](), junk, image_qkv, layout)
    assert torch.equal(image_junk, image_out)
    assert torch.equal(text_junk, text_out)


def test_joint_metadata_values():
    meta = joint_attention_metadata(torch.tensor([3, 5]), 16, text_width=5)
    assert meta.cu_seqlens_q.tolist() == [0, 19, 40] and meta.cu_seqlens_k.tolist() == [0, 19, 40]
    assert meta.cu_seqlens_q.dtype == torch.int32
    assert (meta.max_seqlen_q, meta.max_seqlen_k) == (21, 21)
    assert joint_attention_metadata([5, 5], 16, text_width=5) == AttentionMetadata()  # nothing padded
    with pytest.raises(ValidationError, match="text_lens"):
        joint_attention_metadata([6], 16, text_width=5)


def test_joint_layout_rows():
    """Row b: its prompt tokens, its image tokens, then its padding; split undoes join."""
    lens, width, tokens = [1, 3], 3, 2
    layout = JointTokens.build(lens, tokens, text_width=width)
    text = torch.tensor([[10, 11, 12], [20, 21, 22]]).view(2, 3, 1, 1)
    image = torch.tensor([[-1, -2], [-3, -4]]).view(2, 2, 1, 1)
    joint = layout.join(text, image)
    assert joint.flatten(1).tolist() == [[10, -1, -2, 11, 12], [20, 21, 22, -3, -4]]
    assert all(torch.equal(a, b) for a, b in zip(layout.split(joint), (text, image), strict=True))
    full = JointTokens.build([3, 3], tokens, text_width=width)
    assert full.metadata.is_dense and torch.equal(full.join(text, image), torch.cat([text, image], 1))


def test_config_from_diffusers_dict():
    released = {
        "_class_name": "QwenImageTransformer2DModel",
        "attention_head_dim": 128,
        "axes_dims_rope": [16, 56, 56],
        "guidance_embeds": False,
        "in_channels": 64,
        "joint_attention_dim": 3584,
        "num_attention_heads": 24,
        "num_layers": 60,
        "out_channels": 16,
        "patch_size": 2,
        "pooled_projection_dim": 768,
    }
    assert QwenImageConfig.from_diffusers(released) == QwenImageConfig()
    with pytest.raises(ValidationError, match="unknown keys"):
        QwenImageConfig.from_diffusers({**released, "mystery": 1})
    with pytest.raises(ValidationError, match="axes_dims_rope"):
        QwenImageConfig(attention_head_dim=64)
    with pytest.raises(ValidationError, match="zero_cond_t"):
        QwenImageConfig(zero_cond_t=True)


def test_true_cfg_keeps_the_conditional_norm():
    generator = torch.Generator().manual_seed(5)
    cond, uncond = (torch.randn(2, 6, 8, generator=generator) for _ in range(2))
    out = true_cfg_combine(cond, uncond, 4.0)
    torch.testing.assert_close(out.norm(dim=-1), cond.norm(dim=-1))
    combined = uncond + 4.0 * (cond - uncond)
    torch.testing.assert_close(F.cosine_similarity(out, combined, dim=-1), torch.ones(2, 6))


def test_bf16_follows_diffusers_roundings(models):
    """bfloat16, one prompt: the same ops in the same order as diffusers, so the same bits (SDPA on CPU)."""
    reference, ours = (copy.deepcopy(model).to(torch.bfloat16) for model in models)
    grid = (1, 3, 5)
    latents, timestep, text = (t.to(torch.bfloat16) for t in _inputs(1, grid, 7, seed=6))
    timestep = timestep.float()
    expected = _diffusers(reference, latents, timestep, text, grid)
    assert torch.equal(_ours(ours, latents, timestep, text, grid, "sdpa"), expected)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("impl", ["flash", "sdpa"])
def test_cuda_packed_joint_attention_bf16(impl):
    """On the GPU kernels (FlashAttention's first installed provider, or SDPA): bf16 packed joint
    attention within bf16 rounding of the float32 dense-masked result; padding never read."""
    generator = torch.Generator(device="cuda").manual_seed(7)
    lens, width, image_tokens, heads, head_dim = [77, 5, 128], 128, 1000, 4, 128

    def rand(tokens):
        return torch.randn(
            3, len(lens), tokens, heads, head_dim, device="cuda", generator=generator
        )  # q, k, v

    image_qkv, text_qkv = tuple(rand(image_tokens).unbind(0)), tuple(rand(width).unbind(0))
    image_ref, text_ref = _dense_masked(image_qkv, text_qkv, lens)
    attention = FlashAttentionImpl() if impl == "flash" else SDPAImpl()
    layout = JointTokens.build(lens, image_tokens, text_width=width, device="cuda")
    bf16 = [tuple(t.bfloat16() for t in qkv) for qkv in (text_qkv, image_qkv)]
    text_out, image_out = joint_attend(attention, *bf16, layout)
    assert (image_out.float() - image_ref).abs().max().item() <= 2e-2
    for row, length in enumerate(lens):
        assert (text_out[row, :length].float() - text_ref[row, :length]).abs().max().item() <= 2e-2
    junk = tuple(t.clone() for t in bf16[0])
    for t in junk:
        for row, length in enumerate(lens):
            t[row, length:] = 1e3
    text_junk, image_junk = joint_attend(attention, junk, bf16[1], layout)
    assert torch.equal(image_junk, image_out) and torch.equal(text_junk, text_out)


@needs_cuda
def test_cuda_model_bf16_close_to_diffusers():
    """bf16 on the GPU, a padded batch of two prompts: mmgen (FlashAttention, packed) is as close to the
    float32 result as diffusers' own bf16 call (SDPA with its dense mask)."""
    diffusers = pytest.importorskip("diffusers")
    config = {**TINY, "attention_head_dim": 64, "axes_dims_rope": (16, 24, 24)}
    torch.manual_seed(0)
    reference = diffusers.QwenImageTransformer2DModel(**config).eval()
    generator = torch.Generator().manual_seed(1)
    reference.load_state_dict({n: _random_like(n, v, generator) for n, v in reference.state_dict().items()})
    ours = QwenImageTransformer(QwenImageConfig(**config)).eval()
    ours.load_state_dict(reference.state_dict())
    grid, lens = (1, 12, 10), [9, 4]
    latents, timestep, text = _inputs(2, grid, max(lens), seed=8)
    mask = torch.zeros(2, max(lens), dtype=torch.long)
    for row, length in enumerate(lens):
        text[row, length:] = 0
        mask[row, :length] = 1
    cuda = [t.cuda() for t in (latents, timestep, text, mask)]
    exact = _diffusers(reference.cuda(), *cuda[:3], grid, cuda[3])
    theirs = _diffusers(reference.bfloat16(), cuda[0].bfloat16(), cuda[1], cuda[2].bfloat16(), grid, cuda[3])
    with torch.no_grad():
        got = ours.cuda().bfloat16()(
            cuda[0].bfloat16(),
            cuda[1],
            cuda[2].bfloat16(),
            grids=(grid,),
            attention=FlashAttentionImpl(),
            text_lens=lens,
        )
    their_error = (theirs.float() - exact).abs().max().item()
    assert (got.float() - exact).abs().max().item() <= 1.5 * their_error + 1e-2
