"""The "concat" LoRA kernel (mmgen.layers.low_rank, mmgen.lora.pack): [x | x D^T] [W | U]^T + b in one GEMM.

On CPU in fp32: a packed stacked group (one layer without LoRA, unequal ranks) equals a float64
reference and the other kernels (<= 1e-5 of the outputs' magnitude); packing leaves every weight's values, objects and views
as they were while their storage becomes the concatenated matrix, and unpacking gives contiguous
weights bitwise; the norms' spare columns leave their first D columns as they were; a model's
norm-fed groups (stacked q/k/v, cross q, FFN up) run concat and the rest does not. The Triton norm
kernel's padded store is checked in Triton's interpreter (where triton is installed), the in-place
mm (no copy of the spare columns) on CUDA.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lora_cases import TINY, diffusers_lora, relative_error
from lora_cases import low_rank_reference as _reference
from torch import nn

from mmgen.attention import FlashAttentionImpl, SDPAImpl
from mmgen.attention.metadata import AttentionMetadata
from mmgen.kernels import probe_provider
from mmgen.kernels.varlen import pack_padded_rows
from mmgen.layers.fused_norms import layer_norm_modulate, residual_layer_norm
from mmgen.layers.low_rank import LowRankLinear, concat_columns, low_rank_linear, set_low_rank_kernel
from mmgen.lora import LoRARequest, apply_loras, parse_lora
from mmgen.lora.names import takes_padded_input
from mmgen.lora.pack import pack_concat, unpack_concat
from mmgen.lora.readers import LoRAFile
from mmgen.models.settings import ExecutionSettings
from mmgen.models.wan import WanConfig, WanDiT

# concat runs the other kernels' formula as one wider GEMM ([x | x D^T] [W | U]^T): fp32 rounding of
# another shape, a few ulps per op in an order each CPU's BLAS picks. 1e-5 absolute on the tiny DiT's
# O(1) outputs; on the stacked groups, whose outputs reach ~20, 1e-5 of the largest (relative_error).
TOLERANCE = 1e-5


class _Stack(nn.Module):
    """Three Linear(12 -> 8) whose weights are row views of one stacked matrix (as fuse_projections makes)."""

    def __init__(self, seed: int, with_lora=(True, False, True)) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        layers = []
        for index, lora in enumerate(with_lora):
            base = nn.Linear(12, 8)
            with torch.no_grad():
                base.weight.copy_(torch.randn(8, 12, generator=gen))
                base.bias.copy_(torch.randn(8, generator=gen))
            if lora:  # ranks 3 and 5: total 8, no padding; rank 3 alone pads to 8
                rank = 3 + index
                base = LowRankLinear(
                    base, torch.randn(rank, 12, generator=gen), torch.randn(8, rank, generator=gen)
                )
            layers.append(base)
        self.layers = nn.ModuleList(layers)
        with torch.no_grad():
            stacked = torch.cat([layer.weight for layer in layers])
            for index, layer in enumerate(layers):
                layer.weight.data = stacked[index * 8 : (index + 1) * 8]
        self.register_buffer("stacked", stacked)
        self.bias = torch.cat([layer.bias.detach() for layer in layers])
        self.x = torch.randn(2, 5, 12, generator=gen)


def _padded(x: torch.Tensor, spare: int) -> torch.Tensor:
    buffer = torch.full((*x.shape[:-1], x.shape[-1] + spare), float("nan"))  # scratch: never read
    buffer[..., : x.shape[-1]] = x
    return buffer


@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
@pytest.mark.parametrize("with_lora", [(True, False, True), (False, True, False)])
def test_packed_group_equals_the_reference_and_the_other_kernels(activation, with_lora):
    stack = _Stack(0, with_lora)
    layers, x = list(stack.layers), stack.x
    before = {name: t.detach().clone() for name, t in stack.state_dict().items()}
    with torch.no_grad():
        expected_other = low_rank_linear(x, stack.stacked, stack.bias, layers, activation)  # shared-down
        (holder,) = pack_concat(stack, lambda names: True)
        spare = concat_columns(layers, stack.stacked)
        assert spare == 8 and holder is next(m for m in layers if isinstance(m, LowRankLinear))
        got = low_rank_linear(_padded(x, spare), stack.stacked, stack.bias, layers, activation)
    assert got.shape == (2, 5, 24)
    assert relative_error(got, _reference(layers, x, activation)) <= TOLERANCE
    assert relative_error(got, expected_other) <= TOLERANCE
    # One copy: the weights and the stack are the first 12 columns of the concatenated matrix.
    cat = holder.concat_weight
    assert cat.shape == (24, 20) and stack.stacked.data_ptr() == cat.data_ptr()
    assert layers[1].weight.data_ptr() == cat[8:].data_ptr() and layers[1].weight.stride() == (20, 1)
    assert all(torch.equal(stack.state_dict()[name], value) for name, value in before.items())
    with torch.no_grad():
        unpack_concat(stack, [holder])
    assert holder.concat_weight is None and concat_columns(layers, stack.stacked) == 0
    assert stack.stacked.is_contiguous() and layers[2].weight.data_ptr() == stack.stacked[16:].data_ptr()
    assert all(torch.equal(stack.state_dict()[name], value) for name, value in before.items())


def test_wider_alignment_adds_zero_columns_with_the_same_result():
    stack = _Stack(7)
    layers = list(stack.layers)
    with torch.no_grad():
        with pytest.raises(ValueError, match="align=12"):
            pack_concat(stack, lambda names: True, align=12)
        (holder,) = pack_concat(stack, lambda names: True, align=32)  # rank 8 -> 32 spare columns
        assert concat_columns(layers, stack.stacked) == 32 and holder.concat_weight.shape == (24, 44)
        got = low_rank_linear(_padded(stack.x, 32), stack.stacked, stack.bias, layers)
        unpack_concat(stack, [holder])
    assert relative_error(got, _reference(layers, stack.x)) <= TOLERANCE


def test_concat_needs_its_own_weight_and_the_padded_width():
    stack = _Stack(1)
    layers = list(stack.layers)
    with torch.no_grad():
        pack_concat(stack, lambda names: True)
        # A single layer of the group is not the packed matrix: no spare columns, its other kernel runs.
        assert concat_columns(layers[:1], layers[0].weight) == 0
        set_low_rank_kernel(stack, "fused-add")
        assert concat_columns(layers, stack.stacked) == 0
        set_low_rank_kernel(stack, "concat")
        assert concat_columns(layers, stack.stacked) == 8
        out = low_rank_linear(
            stack.x, stack.stacked, stack.bias, layers
        )  # unpadded: runs fused-add's formula
        assert relative_error(out, _reference(layers, stack.x)) <= TOLERANCE
        with pytest.raises(ValueError, match="input has 15 columns; the weight takes 12 or 20 padded"):
            low_rank_linear(_padded(stack.x, 3), stack.stacked, stack.bias, layers)
        moved = stack.stacked.double().float()  # a copy: contiguous, another storage
        assert concat_columns(layers, moved) == 0


def test_pack_skips_a_storage_that_is_not_plain_rows():
    stack = _Stack(2)
    stack.register_buffer("odd", stack.stacked.view(-1)[:7])  # another layout over the same storage
    assert pack_concat(stack, lambda names: True) == []
    assert concat_columns(list(stack.layers), stack.stacked) == 0


@pytest.mark.parametrize("spare", [0, 8])
def test_norms_spare_columns_keep_the_values(spare):
    gen = torch.Generator().manual_seed(3)
    x, update = torch.randn(2, 5, 16, generator=gen), torch.randn(2, 5, 16, generator=gen)
    shift, scale, gate = (torch.randn(2, 1, 16, generator=gen) for _ in range(3))
    plain = layer_norm_modulate(x, eps=1e-6, shift=shift, scale=scale)
    padded = layer_norm_modulate(x, eps=1e-6, shift=shift, scale=scale, spare_columns=spare)
    assert padded.shape == (2, 5, 16 + spare) and torch.equal(padded[..., :16], plain)
    x_new, h = residual_layer_norm(x, update, gate, eps=1e-6, shift=shift, scale=scale)
    x_pad, h_pad = residual_layer_norm(
        x, update, gate, eps=1e-6, shift=shift, scale=scale, spare_columns=spare
    )
    assert torch.equal(x_pad, x_new) and h_pad.shape == (2, 5, 16 + spare) and torch.equal(h_pad[..., :16], h)
    with pytest.raises(ValueError, match="spare_columns=8"):
        layer_norm_modulate(x, eps=1e-6, spare_columns=8, fp8=True)


def test_names_of_the_groups_with_padded_inputs():
    qkv = tuple(f"blocks.3.attn1.to_{p}" for p in "qkv")
    assert takes_padded_input(qkv) and takes_padded_input(("blocks.0.ffn.net.0.proj",))
    assert takes_padded_input(("blocks.1.attn2.to_q",))
    assert takes_padded_input(("blocks.3.attn1.to_out.0",)) and takes_padded_input(
        ("blocks.0.attn2.to_out.0",)
    )
    assert not takes_padded_input(qkv[:1]) and not takes_padded_input(("blocks.3.ffn.net.2",))
    assert not takes_padded_input(("blocks.1.attn2.to_k", "blocks.1.attn2.to_v"))
    assert not takes_padded_input(("blocks.1.attn1.to_q", "blocks.2.attn1.to_k", "blocks.1.attn1.to_v"))


@pytest.mark.parametrize("fuse_qkv", [False, True])
def test_model_runs_concat_on_its_padded_groups_and_matches_the_other_kernels(fuse_qkv):
    torch.manual_seed(0)
    model = WanDiT(TINY).eval()
    if fuse_qkv:
        model.fuse_projections()
    base = {name: t.detach().clone() for name, t in model.state_dict().items()}
    state, metadata = diffusers_lora(model, rank=4)
    lora = LoRAFile(Path("mem"), "0" * 64, parse_lora(state, metadata, source="mem"))
    gen = torch.Generator().manual_seed(1)
    x = (
        torch.randn(1, 4, 3, 4, 6, generator=gen),
        torch.tensor([700.0]),
        torch.randn(1, 16, 32, generator=gen),
    )
    # The reference FlashAttention writes into a given buffer (as FA3 does on a GPU): the o-projections
    # then run concat too; SDPA does not, and they run their other kernel.
    writes, plain = FlashAttentionImpl("reference"), SDPAImpl()
    assert writes.writes_out and not getattr(plain, "writes_out", False)
    with torch.no_grad():
        applied = apply_loras([model], [(LoRARequest(lora.path, 0.7), lora)], mode="unfused")
        block = model.blocks[1]
        # rank 4 per layer: q/k/v 12 -> 16 spare; cross q, FFN up and both o 4 -> 8; FFN down, cross k/v none.
        assert block.attn1.spare_columns(self_attention=True) == (16 if fuse_qkv else 0)
        assert block.attn2.spare_columns(self_attention=False) == 8
        assert concat_columns((block.ffn.net[0].proj,), block.ffn.net[0].proj.weight) == 8
        assert block.attn1.output_spare_columns(writes) == 8 == block.attn2.output_spare_columns(writes)
        assert block.attn1.output_spare_columns(plain) == 0 == block.attn2.output_spare_columns(plain)
        assert block.ffn.net[2].concat_weight is None and block.attn2.to_k.concat_weight is None
        assert len(applied.packed[0][1]) == (5 if fuse_qkv else 4) * TINY.num_layers
        runs = {name: model(*x, attention=impl) for name, impl in (("sdpa", plain), ("flash", writes))}
        # token ranges: the padded buffers are cut into ranges too
        chunks = ExecutionSettings(block_chunk=5, ffn_chunk=7)
        runs["chunked sdpa"] = model(*x, attention=plain, settings=chunks)
        runs["chunked flash"] = model(*x, attention=writes, settings=chunks)
        set_low_rank_kernel(model, "shared-down")
        other = model(*x, attention=plain)
        applied.remove()
    for name, got in runs.items():
        assert (got - other).abs().max().item() <= TOLERANCE, name
    state = model.state_dict()
    assert all(torch.equal(state[name], value) for name, value in base.items())
    assert all(p.is_contiguous() for p in model.parameters())


def test_image_cross_attention_sums_into_the_padded_rows():
    # I2V: the cross-attention output is the text part plus the image part before to_out.
    torch.manual_seed(5)
    config = dataclasses.replace(TINY, in_channels=8, image_dim=24, added_kv_proj_dim=32)
    model = WanDiT(config).eval().fuse_projections()
    state, metadata = diffusers_lora(model, rank=4)
    lora = LoRAFile(Path("mem"), "0" * 64, parse_lora(state, metadata, source="mem"))
    gen = torch.Generator().manual_seed(6)
    x = (
        torch.randn(1, 8, 3, 4, 6, generator=gen),
        torch.tensor([300.0]),
        torch.randn(1, 16, 32, generator=gen),
    )
    image = torch.randn(1, 5, 24, generator=gen)
    writes = FlashAttentionImpl("reference")
    with torch.no_grad():
        applied = apply_loras([model], [(LoRARequest(lora.path, 1.0), lora)], mode="unfused")
        assert model.blocks[0].attn2.output_spare_columns(writes) == 8
        got = model(*x, attention=writes, image_embeds=image)
        set_low_rank_kernel(model, "shared-down")
        other = model(*x, attention=writes, image_embeds=image)
        applied.remove()
    assert (got - other).abs().max().item() <= TOLERANCE


def test_compiled_blocks_write_the_attention_into_padded_rows():
    # compile_blocks: the attention call (eager, between compiled regions) fills a buffer the graph made.
    torch.manual_seed(0)
    model = WanDiT(TINY).eval().fuse_projections()
    state, metadata = diffusers_lora(model, rank=4)
    lora = LoRAFile(Path("mem"), "0" * 64, parse_lora(state, metadata, source="mem"))
    x = (torch.randn(1, 4, 3, 4, 6), torch.tensor([700.0]), torch.randn(1, 16, 32))
    try:
        with torch.no_grad():
            applied = apply_loras([model], [(LoRARequest(lora.path, 0.7), lora)], mode="unfused")
            eager = model(*x, attention=FlashAttentionImpl("reference"))
            torch._dynamo.reset()
            model.compile_blocks(backend="aot_eager")
            compiled = model(*x, attention=FlashAttentionImpl("reference"))
            applied.remove()
    finally:
        torch._dynamo.reset()
    # aot_eager runs the blocks as decomposed ops (norms, GELU, the stacked q/k/v in the graph): fp32
    # rounding of other op sequences, a few ulps of these O(1) outputs (3.6e-7 measured), not bits.
    assert (compiled - eager).abs().max().item() <= TOLERANCE


def test_attention_writes_into_padded_rows_with_the_same_values():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 6, 2, 8, generator=gen) for _ in range(3))
    impl = FlashAttentionImpl("reference")
    lengths = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, 6, 10], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 3, 9], dtype=torch.int32),
    )
    for meta in (AttentionMetadata(), lengths):
        expected = impl(q, k, v, meta)
        buffer = torch.full((2, 6, 16 + 8), float("nan"))
        got = impl(q, k, v, meta, out=buffer[..., :16].unflatten(2, (2, 8)))
        assert got.data_ptr() == buffer.data_ptr() and torch.equal(buffer[..., :16], expected.flatten(2))
        assert buffer[..., 16:].isnan().all()  # the spare columns are the LoRA kernel's
    with pytest.raises(ValueError, match="attention out="):
        impl(q, k, v, AttentionMetadata(), out=torch.empty(2, 6, 2, 4))


_INTERPRETER_CHECK = """
import torch
from mmgen.layers import triton_norms
gen = torch.Generator().manual_seed(0)
x, update = torch.randn(1, 5, 48, generator=gen), torch.randn(1, 5, 48, generator=gen)
shift, scale, gate = (torch.randn(1, 1, 48, generator=gen) for _ in range(3))
_, plain = triton_norms.residual_layer_norm(x, update, gate, None, None, shift, scale, 1e-6)
_, padded = triton_norms.residual_layer_norm(x, update, gate, None, None, shift, scale, 1e-6, spare_columns=16)
assert padded.shape == (1, 5, 64), padded.shape
assert torch.equal(padded[..., :48], plain), (padded[..., :48] - plain).abs().max()
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreter)")
def test_triton_norm_kernel_writes_the_padded_rows_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, "-c", _INTERPRETER_CHECK], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mm_into_the_spare_columns_copies_nothing_on_cuda():
    from torch.profiler import ProfilerActivity, profile

    kw = dict(device="cuda", dtype=torch.bfloat16)
    buffer, down = torch.randn(4096, 1536 + 32, **kw), torch.randn(32, 1536, **kw)
    torch.mm(buffer[:, :1536], down.t(), out=buffer[:, 1536:])  # warm-up (cuBLAS handles)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.mm(buffer[:, :1536], down.t(), out=buffer[:, 1536:])
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels and not [k for k in kernels if "copy" in k.lower() or "elementwise" in k.lower()], kernels
    expected = buffer[:, :1536].float() @ down.float().t()
    assert ((buffer[:, 1536:].float() - expected).abs() / (expected.abs() + 1)).max().item() <= 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_norm_kernels_write_padded_rows_on_cuda():
    pytest.importorskip("triton")
    gen = torch.Generator("cuda").manual_seed(0)
    kw = dict(device="cuda", generator=gen)
    x, update = (torch.randn(2, 300, 1536, **kw).bfloat16() for _ in range(2))
    shift, scale, gate = (torch.randn(2, 1, 1536, **kw) for _ in range(3))
    plain = layer_norm_modulate(x, eps=1e-6, shift=shift, scale=scale)
    padded = layer_norm_modulate(x, eps=1e-6, shift=shift, scale=scale, spare_columns=32)
    assert padded.shape == (2, 300, 1568) and torch.equal(padded[..., :1536], plain)
    x_new, h = residual_layer_norm(x, update, gate, eps=1e-6, shift=shift, scale=scale)
    x_pad, h_pad = residual_layer_norm(x, update, gate, eps=1e-6, shift=shift, scale=scale, spare_columns=96)
    assert torch.equal(x_pad, x_new) and torch.equal(h_pad[..., :1536], h)


@pytest.mark.parametrize("lifo", [True, False])
def test_two_unfused_sets_on_one_stacked_group_stay_exact_and_restore_bitwise(lifo):
    torch.manual_seed(2)
    model = WanDiT(TINY).eval().fuse_projections()
    base = {name: t.detach().clone() for name, t in model.state_dict().items()}
    state, _ = diffusers_lora(model, rank=4)

    def only(part: str) -> LoRAFile:
        picked = {key: value for key, value in state.items() if f"attn1.{part}." in key}
        return LoRAFile(
            Path(f"{part}.safetensors"), part.ljust(64, "0"), parse_lora(picked, None, source=part)
        )

    q, k = only("to_q"), only("to_k")
    gen = torch.Generator().manual_seed(3)
    x = (
        torch.randn(1, 4, 3, 4, 6, generator=gen),
        torch.tensor([500.0]),
        torch.randn(1, 16, 32, generator=gen),
    )
    with torch.no_grad():
        fused = apply_loras(
            [model], [(LoRARequest(q.path, 1.0), q), (LoRARequest(k.path, 1.0), k)], mode="fused"
        )
        expected = model(*x, attention=SDPAImpl())
        fused.remove()
        first = apply_loras([model], [(LoRARequest(q.path, 1.0), q)], mode="unfused")
        second = apply_loras([model], [(LoRARequest(k.path, 1.0), k)], mode="unfused")
        # The group was packed for q alone: with k's LoRA beside it, it runs without concat (and exactly).
        assert model.blocks[0].attn1.spare_columns(self_attention=True) == 0
        got = model(*x, attention=SDPAImpl())
        for applied in (second, first) if lifo else (first, second):
            applied.remove()
    assert (got - expected).abs().max().item() <= TOLERANCE
    state_after = model.state_dict()
    assert all(torch.equal(state_after[name], value) for name, value in base.items())


# fa3-fwd 0.0.3's raw forward op schema (as its extension registers it), for a CPU stand-in below.
_FA3_FWD_SCHEMA = "fwd(Tensor q,Tensor k,Tensor v,Tensor(k_new!)? k_new = None,Tensor(v_new!)? v_new = None,Tensor? q_v = None,Tensor(out!)? out = None,Tensor? cu_seqlens_q = None,Tensor? cu_seqlens_k = None,Tensor? cu_seqlens_k_new = None,Tensor? seqused_q = None,Tensor? seqused_k = None,int? max_seqlen_q = None,int? max_seqlen_k = None,Tensor? page_table = None,Tensor? kv_batch_idx = None,Tensor? leftpad_k = None,Tensor? rotary_cos = None,Tensor? rotary_sin = None,Tensor? seqlens_rotary = None,Tensor? q_descale = None,Tensor? k_descale = None,Tensor? v_descale = None,float? softmax_scale = None,bool is_causal = False,int window_size_left = -1,int window_size_right = -1,int attention_chunk = 0,float softcap = 0.0,bool is_rotary_interleaved = False,Tensor? scheduler_metadata = None,int num_splits = 0,bool? pack_gqa = None,int sm_margin = 0) -> (Tensor(out!), Tensor, Tensor, Tensor)"


def _fa3_stand_in(*args):
    """What FA3's raw op computes, on CPU, through the reference kernel: the result written into `out`.
    The dispatcher passes the arguments positionally, in the schema's order (trailing defaults left out)."""
    from mmgen.kernels import flash_attn as reference

    schema = torch._C.parse_schema(_FA3_FWD_SCHEMA).arguments
    a = {arg.name: args[i] if i < len(args) else arg.default_value for i, arg in enumerate(schema)}
    assert a["num_splits"] == 1 and a["is_rotary_interleaved"] and a["k_new"] is None  # as the wrappers pass
    q, k, v, scale, causal = a["q"], a["k"], a["v"], a["softmax_scale"], a["is_causal"]
    if a["cu_seqlens_q"] is None:
        result = reference.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
    else:
        result = reference.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=a["cu_seqlens_q"], cu_seqlens_k=a["cu_seqlens_k"],
            max_seqlen_q=a["max_seqlen_q"], max_seqlen_k=a["max_seqlen_k"], seqused_k=a["seqused_k"],
            softmax_scale=scale, causal=causal,
        )  # fmt: skip
    result = result[0] if isinstance(result, tuple) else result
    out = result.clone() if a["out"] is None else a["out"].copy_(result)
    return out, torch.empty(0), torch.empty(0), torch.empty(0)


def test_fa3_raw_op_arguments_bind_to_its_schema_on_cpu():
    # The GPU op cannot load here: a CPU op with its exact schema checks every argument the provider passes.
    library = torch.library.Library("mmgen_fa3_schema_check", "DEF")
    library.define(_FA3_FWD_SCHEMA)
    library.impl("fwd", _fa3_stand_in, "CPU")
    op = torch.ops.mmgen_fa3_schema_check.fwd
    impl = FlashAttentionImpl("reference")
    impl.kernel.forward_into = op
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 6, 2, 8, generator=gen) for _ in range(3))
    keys = AttentionMetadata(cu_seqlens_k=torch.tensor([0, 4, 10], dtype=torch.int32))
    for meta in (AttentionMetadata(), keys):
        expected = FlashAttentionImpl("reference")(q, k, v, meta).flatten(2)
        buffer = torch.full((2, 6, 16 + 8), float("nan"))
        impl(
            q,
            k,
            v.transpose(1, 2).contiguous().transpose(1, 2),
            meta,
            out=buffer[..., :16].unflatten(2, (2, 8)),
        )
        assert (buffer[..., :16] - expected).abs().max().item() <= 1e-6 and buffer[..., 16:].isnan().all()
    # without an out as well (eager code): the raw op into a fresh output, never the wrappers' custom ops
    wrappers = ("flash_attn_func", "flash_attn_varlen_func")
    before = {name: impl.kernel.calls[name] for name in ("flash_attn_into", *wrappers)}
    for meta in (AttentionMetadata(), keys):
        expected = FlashAttentionImpl("reference")(q, k, v, meta)
        assert (impl(q, k, v, meta) - expected).abs().max().item() <= 1e-6
    assert impl.kernel.calls["flash_attn_into"] == before["flash_attn_into"] + 2
    assert all(impl.kernel.calls[name] == before[name] for name in wrappers)


def _fa3_into() -> FlashAttentionImpl:
    provider = probe_provider("fa3") if torch.cuda.is_available() else None
    if provider is None or provider.forward_into is None:
        pytest.skip("needs CUDA and fa3-fwd (its raw op writes into a given out)")
    impl = FlashAttentionImpl("fa3")
    assert impl.writes_out
    return impl


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fa3_writes_padded_rows_bitwise_on_cuda():
    impl = _fa3_into()
    gen = torch.Generator("cuda").manual_seed(0)
    kw = dict(device="cuda", generator=gen)
    q, k, v = (torch.randn(2, 700, 12, 128, **kw).bfloat16() for _ in range(3))
    text_k, text_v = (torch.randn(2, 64, 12, 128, **kw).bfloat16() for _ in range(2))
    lengths = AttentionMetadata(cu_seqlens_k=torch.tensor([0, 20, 84], dtype=torch.int32, device="cuda"))
    scale = 128**-0.5
    dense = impl.kernel.flash_attn_func(q, k, v, softmax_scale=scale, causal=False)  # fa3-fwd's wrapper
    rows = pack_padded_rows(q, text_k, text_v, torch.tensor([20, 64], dtype=torch.int32, device="cuda"))
    padded = rows.rows(
        impl.kernel.flash_attn_varlen_func(rows.q, rows.k, rows.v, **rows.keywords(), softmax_scale=scale)
    )
    # dense (self-attention) and padded keys (cross-attention)
    for keys, values, meta, wrapper in (
        (k, v, AttentionMetadata(), dense),
        (text_k, text_v, lengths, padded),
    ):
        expected = impl(q, keys, values, meta, scale=scale)  # eager, no out: the raw op too
        assert torch.equal(expected, wrapper)  # the same kernel and tiling as the wrapper: the same bits
        expected = expected.flatten(2)
        buffer = torch.full((2, 700, 1536 + 32), float("nan"), device="cuda", dtype=torch.bfloat16)
        got = impl(q, keys, values, meta, scale=scale, out=buffer[..., :1536].unflatten(2, (12, -1)))
        assert got.data_ptr() == buffer.data_ptr()
        assert torch.equal(buffer[..., :1536], expected)
        assert buffer[..., 1536:].isnan().all()


def _bf16_model_concat_error(device: str, impl) -> float:
    """Max |auto - shared-down| / max |shared-down| of a bf16 model with a rank-8 LoRA on every block
    Linear, q/k/v stacked, the attention `impl` (o-projections on concat when it writes into rows)."""
    config = WanConfig(
        num_attention_heads=2, attention_head_dim=128, in_channels=4, out_channels=4, text_dim=32,
        freq_dim=32, ffn_dim=512, num_layers=2, rope_max_seq_len=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = WanDiT(config).eval()
    state, metadata = diffusers_lora(model, rank=8)
    model = model.to(device=device, dtype=torch.bfloat16)
    for name, param in model.named_parameters():  # as the loaders keep them
        if WanDiT.keeps_fp32(name):
            param.data = param.data.float()
    model.fuse_projections()
    state = {key: value.to(device=device, dtype=torch.bfloat16) for key, value in state.items()}
    lora = LoRAFile(Path("mem"), "0" * 64, parse_lora(state, metadata, source="mem"))
    gen = torch.Generator(device).manual_seed(1)
    x = (
        torch.randn(2, 4, 3, 16, 16, device=device, generator=gen),
        torch.tensor([700.0, 700.0], device=device),
        torch.randn(2, 16, 32, device=device, generator=gen).bfloat16(),
    )
    with torch.no_grad():
        applied = apply_loras([model], [(LoRARequest(lora.path, 1.0), lora)], mode="unfused")
        spare = (
            model.blocks[0].attn1.output_spare_columns(impl),
            model.blocks[1].attn2.output_spare_columns(impl),
        )
        assert spare == (8, 8)
        auto = model(*x, attention=impl).float()
        set_low_rank_kernel(model, "shared-down")
        other = model(*x, attention=impl).float()
        applied.remove()
    return ((auto - other).abs().max() / other.abs().max()).item()


def test_bf16_model_concat_on_the_o_projections():
    assert _bf16_model_concat_error("cpu", FlashAttentionImpl("reference")) <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_model_concat_on_the_o_projections_with_fa3_on_cuda():
    assert _bf16_model_concat_error("cuda", _fa3_into()) <= 2e-2
