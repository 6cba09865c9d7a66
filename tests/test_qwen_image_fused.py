"""Qwen-Image's row-kernel block path (QwenImageBlock.forward_fused) against its torch path.

On CPU the fused path runs the kernels' torch references, so in float32 it must equal the plain
block to float32 rounding: that checks the fused path's data flow (q/k written straight into the
joint rows, keys-only metadata, to_out on each sample's image rows). On CUDA the Triton kernels run
and compute in float32 where the torch path rounds to bf16 between ops: bounded by bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch

from mmgen.attention.impls import FlashAttentionImpl, SDPAImpl
from mmgen.layers.fused_norms import head_rms_norm_rope
from mmgen.models.qwen_image_blocks import QwenImageBlock, QwenImageCall, qwen_rope
from mmgen.models.qwen_image_joint import JointTokens

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _block_inputs(dim, heads, head_dim, grids, lens, width, device, dtype, seed=0):
    """A random block and its call's inputs; grids: the image grids in token order (Qwen-Image-Edit
    has two: the noise, then the input image's latents)."""
    generator = torch.Generator().manual_seed(seed)
    block = QwenImageBlock(dim, heads, head_dim)
    with torch.no_grad():
        for name, param in block.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(noise * param.shape[1] ** -0.5 if param.dim() == 2 else 0.1 * noise)
    block = block.to(device, dtype).eval()
    tokens = sum(f * h * w for f, h, w in grids)
    image = torch.randn(len(lens), tokens, dim, generator=generator).to(device, dtype)
    text = torch.randn(len(lens), width, dim, generator=generator).to(device, dtype)
    temb = torch.randn(len(lens), dim, generator=generator).to(device, dtype)
    axes = {24: (4, 10, 10), 128: (16, 56, 56)}[head_dim]
    rope = qwen_rope(grids, width, axes, device=device)
    joint = JointTokens.build(lens, tokens, text_width=width, device=device)
    return block, (image, text, temb, rope, joint)


def _run(forward, args, attention):
    """A block's forward (or forward_fused) on _block_inputs' args, its call record made here."""
    image, text, temb, rope, joint = args
    return forward(image, text, QwenImageCall(attention=attention, metadata=joint, rope=rope, temb=temb))


def _max_error(got, want, lens):
    """Max abs difference over the image rows and each sample's prompt rows (padding rows are free)."""
    image_error = (got[0].float() - want[0].float()).abs().max().item()
    text_error = max(
        (got[1][row, :length].float() - want[1][row, :length].float()).abs().max().item()
        for row, length in enumerate(lens)
        if length
    )
    return max(image_error, text_error)


@pytest.mark.parametrize("attention", [SDPAImpl, lambda: FlashAttentionImpl("reference")])
@pytest.mark.parametrize(
    ("lens", "grids"),
    [([5, 2], [(1, 3, 5)]), ([6, 6], [(1, 3, 5)]), ([0, 3], [(1, 3, 5)]), ([5, 2], [(1, 3, 5), (1, 2, 4)])],
)
def test_fused_path_equals_torch_path_fp32(attention, lens, grids):
    block, args = _block_inputs(48, 2, 24, grids, lens, 6, "cpu", torch.float32)
    impl = attention()
    with torch.no_grad():
        plain = _run(block, args, impl)
        fused = _run(block.forward_fused, args, impl)
    assert _max_error(fused, plain, lens) <= 1e-5  # float32: the same math, other op order


def test_head_rms_norm_rope_reference_scatters_rows():
    """Rows land at out_rows; each head normalized on its own (a head scaled by 10 gives the same)."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 8, generator=generator)
    scaled = x.clone()
    scaled[..., 4:] *= 10  # the second head of 4
    weight = torch.ones(4)
    rows = torch.tensor([5, 0, 2, 1, 3, 4])
    out_a, out_b = torch.zeros(6, 8), torch.zeros(6, 8)
    head_rms_norm_rope(x, weight, 1e-12, out=out_a, out_rows=rows)
    head_rms_norm_rope(scaled, weight, 1e-12, out=out_b, out_rows=rows)
    assert torch.allclose(out_a, out_b, atol=1e-6)
    heads = x.view(6, 2, 4)
    want = heads / heads.pow(2).mean(-1, keepdim=True).add(1e-12).sqrt()
    assert torch.allclose(out_a[rows], want.view(6, 8), atol=1e-6)


@needs_cuda
def test_cuda_head_rms_norm_rope_kernel_matches_reference():
    generator = torch.Generator(device="cuda").manual_seed(0)
    batch, seq, heads, head_dim = 2, 300, 24, 128
    wide = torch.randn(batch, seq, 3 * heads * head_dim, device="cuda", generator=generator).bfloat16()
    x = wide[..., heads * head_dim : 2 * heads * head_dim]  # a column slice, as a stacked projection's k
    weight = (1 + 0.1 * torch.randn(head_dim, device="cuda", generator=generator)).bfloat16()
    angles = torch.rand(seq, head_dim // 2, device="cuda", generator=generator) * 6
    cos, sin = angles.cos(), angles.sin()
    rope = (torch.stack((cos, cos), -1).flatten(-2), torch.stack((-sin, sin), -1).flatten(-2))
    rows = torch.randperm(batch * seq + 7, device="cuda", generator=generator)[: batch * seq]
    got = torch.zeros(batch * seq + 7, heads * head_dim, device="cuda", dtype=torch.bfloat16)
    want = torch.zeros_like(got)
    head_rms_norm_rope(x, weight, 1e-6, out=got, out_rows=rows, rope=rope)
    head_rms_norm_rope(x, weight, 1e-6, out=want, out_rows=rows, rope=rope, kernel=False)
    assert (got.float() - want.float()).abs().max().item() <= 2**-7 * want.abs().max().item()
    untouched = torch.ones(batch * seq + 7, dtype=torch.bool, device="cuda")
    untouched[rows] = False
    assert got[untouched].abs().max().item() == 0


@needs_cuda
@pytest.mark.parametrize(
    ("lens", "grids"),
    [([77, 12], [(1, 16, 20)]), ([40, 40], [(1, 16, 20)]), ([77, 12], [(1, 16, 20), (1, 12, 14)])],
)
def test_cuda_fused_block_close_to_torch_path(lens, grids):
    """bf16 on the GPU (FlashAttention): the kernel path within bf16 rounding of the torch path, both
    against the float32 block."""
    block, args = _block_inputs(3072 // 8, 3, 128, grids, lens, 80, "cuda", torch.float32)
    exact = _run(block, args, SDPAImpl())
    bf16_args = tuple(a.bfloat16() if isinstance(a, torch.Tensor) else a for a in args)
    block = block.bfloat16()
    impl = FlashAttentionImpl()
    with torch.no_grad():
        fused = _run(block, bf16_args, impl)
        block.set_fused_kernels(False)
        plain = _run(block, bf16_args, impl)
    plain_error = _max_error(plain, exact, lens)
    assert _max_error(fused, exact, lens) <= 1.5 * plain_error + 1e-2


def test_fused_path_with_an_unfused_lora_equals_torch_path(tmp_path):
    """The fused path runs a LoRA-wrapped projection through the layer (q/k through the row kernel's
    input, v and to_out through the copy fallback): fp32 equal to the torch path."""
    from safetensors.torch import save_file

    from mmgen.lora import LoRARequest, LoRASlot, read_lora_file
    from mmgen.lora.qwen_image import parse_qwen_image_lora
    from mmgen.models.qwen_image import QwenImageConfig, QwenImageTransformer

    config = QwenImageConfig(
        in_channels=16, out_channels=4, num_layers=1, attention_head_dim=24, num_attention_heads=2,
        joint_attention_dim=20, axes_dims_rope=(4, 10, 10),
    )  # fmt: skip
    model = QwenImageTransformer(config).eval()
    generator = torch.Generator().manual_seed(11)
    state = {}
    for name in ("to_q", "to_k", "to_v", "to_out.0", "add_v_proj", "to_add_out"):
        layer = model.transformer_blocks[0].attn.get_submodule(name)
        prefix = f"transformer_blocks.0.attn.{name}"
        state[f"{prefix}.lora_A.weight"] = torch.randn(4, layer.in_features, generator=generator) * 0.1
        state[f"{prefix}.lora_B.weight"] = torch.randn(layer.out_features, 4, generator=generator) * 0.1
        state[f"{prefix}.alpha"] = torch.tensor(8.0)
    path = tmp_path / "lora.safetensors"
    save_file(state, str(path))
    slot = LoRASlot(reader=lambda p: read_lora_file(p, parse=parse_qwen_image_lora))
    slot.use((model,), [LoRARequest(path=path, strength=0.8)], mode="unfused")
    block, args = _block_inputs(48, 2, 24, [(1, 3, 5)], [5, 2], 6, "cpu", torch.float32)
    block = model.transformer_blocks[0]
    assert type(block.attn.to_q).__name__ != "Linear"  # the LoRA wraps the layers
    with torch.no_grad():
        plain = _run(block, args, SDPAImpl())
        fused = _run(block.forward_fused, args, SDPAImpl())
    assert _max_error(fused, plain, [5, 2]) <= 1e-5
