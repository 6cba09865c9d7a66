"""The Ulysses exchange (mmgen.parallel.attention.qkv_to_heads, heads_to_seq, PackedUlysses): one all-to-all
for q, k and v together must move exactly what one all-to-all per tensor moved, bit for bit (it is data
movement only), in gloo worlds of 2 and 4 forked processes, 8 heads, divisible and padded token counts.

Two references, each compared with torch.equal: the exchange as it was before (one all_to_all_single per
tensor, kept below as written then), and the whole tensor sliced (every rank builds the full q, k, v from
one seed, so rank r's result must be the full sequence of its head group r). And the attention paths the
callers use read the exchange's strided views as they read contiguous tensors (CPU; CUDA with the GPU
kernels installed).
"""

from __future__ import annotations

import parallel_workers
import pytest
import qwen_image21_parallel_workers as qwen_workers
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mmgen.attention import FlashAttentionImpl, SDPAImpl
from mmgen.attention.metadata import AttentionMetadata
from mmgen.attention.segments import SegmentMetadata, segment_attention
from mmgen.kernels.fa_providers import installed_gpu_providers
from mmgen.models.qwen_image21 import PrefixCache
from mmgen.models.qwen_image21_layout import BlockCausalLayout
from mmgen.parallel.attention import heads_to_seq, qkv_to_heads
from mmgen.parallel.layout import ParallelConfig, ParallelLayout
from mmgen.parallel.packed_rows import PackedUlysses
from mmgen.parallel.sequence import SequenceShard

HEADS, DIM = 8, 4
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def per_tensor_seq_to_heads(x: torch.Tensor, group: object, degree: int) -> torch.Tensor:
    """The exchange before one packed all-to-all: one collective per tensor, [B, s, H, D] -> [B, degree * s, H / degree, D]."""
    batch, local, heads, dim = x.shape
    send = x.reshape(batch, local, degree, heads // degree, dim).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received.permute(1, 0, 2, 3, 4).reshape(batch, degree * local, heads // degree, dim)


def per_tensor_heads_to_seq(x: torch.Tensor, group: object, degree: int) -> torch.Tensor:
    """heads_to_seq as it was (always a contiguous() copy before the collective)."""
    batch, total, part, dim = x.shape
    local = total // degree
    send = x.reshape(batch, degree, local, part, dim).transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received.permute(1, 2, 0, 3, 4).reshape(batch, local, degree * part, dim)


def _full(
    batch: int, tokens: int, seed: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, tokens, HEADS, DIM, generator=g).to(device, dtype) for _ in range(3))


def _dense_cases(layout: ParallelLayout) -> dict[str, bool]:
    """Wan's form [B, s, H, D]: batch 1 (views, no copy) and 2 (one copy), fp32 and bf16, padded counts."""
    degree, rank, group = layout.ulysses_degree, layout.ulysses_rank, layout.ulysses_group
    device = layout.collective_device
    part = HEADS // degree
    heads = slice(rank * part, (rank + 1) * part)
    checks = {}
    for batch in (1, 2):
        for dtype in (torch.float32, torch.bfloat16):
            for tokens in (4 * degree, 4 * degree + 1):
                name = f"dense/B={batch}/{dtype}/S={tokens}"
                full = _full(batch, tokens, tokens * 7 + batch, dtype, device)
                shard = SequenceShard.plan(tokens, layout)
                local = [shard.split(x) for x in full]
                new = qkv_to_heads(*local, group, degree)
                old = [per_tensor_seq_to_heads(x, group, degree) for x in local]
                padded = [F.pad(x, (0, 0, 0, 0, 0, shard.padded - tokens)) for x in full]
                for label, got, before, whole in zip("qkv", new, old, padded, strict=True):
                    checks[f"{name}/{label}/equal"] = torch.equal(got, before)
                    checks[f"{name}/{label}/sliced"] = torch.equal(got, whole[:, :, heads])
                    checks[f"{name}/{label}/unit last stride"] = got.stride(-1) == 1
                if batch == 1:  # views of one received buffer: no copy after the collective
                    storage = {x.untyped_storage().data_ptr() for x in new}
                    checks[f"{name}/one buffer"] = len(storage) == 1
                out = torch.randn(new[0].shape, generator=torch.Generator().manual_seed(tokens))
                out = out.to(device, dtype)
                back = heads_to_seq(out, group, degree)
                checks[f"{name}/back/equal"] = torch.equal(back, per_tensor_heads_to_seq(out, group, degree))
    return checks


def _packed_cases(layout: ParallelLayout) -> dict[str, bool]:
    """Qwen-Image-2.1's packed rows [T, H, D]: to_heads / to_rows against the per-tensor exchange, padded rows included."""
    degree, group, device = layout.ulysses_degree, layout.ulysses_group, layout.collective_device
    checks = {}
    for rows in (6 * degree, 6 * degree + 1, 6 * degree - 1):
        plan = PackedUlysses.plan(rows, HEADS, layout)
        full = [x[0] for x in _full(1, rows, rows, torch.float32, device)]
        local = [plan.split(x) for x in full]
        new = plan.to_heads(*local)
        old = [per_tensor_seq_to_heads(x[None], group, degree)[0, :rows] for x in local]
        for label, got, before in zip("qkv", new, old, strict=True):
            checks[f"packed/T={rows}/{label}/equal"] = torch.equal(got, before)
            checks[f"packed/T={rows}/{label}/shape"] = got.shape == (rows, HEADS // degree, DIM)
        out = torch.randn(rows, HEADS // degree, DIM, generator=torch.Generator().manual_seed(rows)).to(
            device
        )
        padded = F.pad(out, (0, 0, 0, 0, 0, plan.shard.padded - rows))
        before = per_tensor_heads_to_seq(padded[None], group, degree)[0]
        checks[f"packed/T={rows}/to_rows/equal"] = torch.equal(plan.to_rows(out), before)
    return checks


def exchange_checks(layout: ParallelLayout) -> dict[str, bool]:
    """Every rank's checks, gathered: {"rank r/case": passed} on rank 0."""
    checks = {**_dense_cases(layout), **_packed_cases(layout)}
    gathered = [None] * layout.sp_degree
    dist.all_gather_object(gathered, checks, group=layout.sp_group)
    return {f"rank{r}/{name}": ok for r, each in enumerate(gathered) for name, ok in each.items()}


@pytest.mark.parametrize("world", [2, 4])
def test_one_packed_exchange_moves_the_bits_of_one_exchange_per_tensor(world):
    checks = parallel_workers.run_forked(exchange_checks, ParallelConfig(sp=world))
    assert {name for name, ok in checks.items() if not ok} == set()
    assert f"rank{world - 1}/packed/T={6 * world + 1}/to_rows/equal" in checks
    assert f"rank{world - 1}/dense/B=1/torch.bfloat16/S={4 * world + 1}/one buffer" in checks


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
def test_one_packed_exchange_over_nccl_moves_the_same_bits():
    from mmgen.parallel.launch import run_parallel

    checks = run_parallel(exchange_checks, ParallelConfig(sp=2), device_type="cuda")
    assert {name for name, ok in checks.items() if not ok} == set()
    assert len(checks) > 100


def test_qkv_to_heads_refuses_tensors_of_different_shapes():
    q = torch.zeros(1, 4, 8, 2)
    with pytest.raises(ValueError, match="one shape and dtype"):
        qkv_to_heads(q, q, q[:, :3], None, 2)


def _impls(device: str) -> list[tuple[str, object]]:
    impls = [("sdpa", SDPAImpl()), ("reference", FlashAttentionImpl("reference"))]
    if device == "cuda":
        impls += [(name, FlashAttentionImpl(name)) for name in installed_gpu_providers()]
    return impls


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_attention_reads_the_exchange_views_in_place(device):
    """q, k, v as qkv_to_heads returns them at batch 1 (views of one [1, S, 3, h, D] buffer: row stride
    3 * h * D) give what their contiguous copies give, through every impl and path the callers use:
    dense, padded keys (Wan's padded shards), block-causal segments (Qwen-Image-2.1). The GPU
    FlashAttention kernels read by strides, so the bits must be equal; the CPU BLAS and SDPA may pack a
    strided operand otherwise, so there a few fp32 ulps are allowed (O(1) outputs; a wrong row or head
    moves them by 0.1 and more)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(3)
    buffer = torch.randn(1, 37, 3, 2, 64, generator=g).to(device, dtype)
    views = (buffer[:, :, 0], buffer[:, :, 1], buffer[:, :, 2])
    copies = tuple(x.contiguous() for x in views)
    assert views[0].stride() == (37 * 3 * 2 * 64, 3 * 2 * 64, 64, 1)
    padded = AttentionMetadata(
        cu_seqlens_k=torch.tensor([0, 30], dtype=torch.int32, device=device), max_seqlen_k=30
    )
    segments = SegmentMetadata.build([5, 32], [0, 0], [5, 37], 37, causal=[True, False], device=device)
    for name, impl in _impls(device):
        if device == "cuda" and name == "reference":
            continue  # the CPU path
        results = []
        for q, k, v in (views, copies):
            results.append(
                [impl(q, k, v, AttentionMetadata()), impl(q, k, v, padded)]
                + [segment_attention(impl, q[0], k[0], v[0], segments)]
            )
        for path, got, expected in zip(("dense", "padded keys", "segments"), *results, strict=True):
            if device == "cuda" and name != "sdpa":
                assert torch.equal(got, expected), (name, path)
            else:
                torch.testing.assert_close(
                    got, expected, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2
                )


def prefix_cache_storage(layout: ParallelLayout) -> list[tuple[bool, int, int]]:
    """A Qwen-Image-2.1 prefill under Ulysses (the world's size): per cached k/v tensor (contiguous, bytes
    of its storage, bytes of its values)."""
    model = qwen_workers.tiny_model()
    inputs = qwen_workers.case_inputs(False)
    blocks = BlockCausalLayout.build(inputs["lens"], inputs["grids"], text_width=inputs["text"].shape[1])
    cache = PrefixCache()
    with torch.no_grad():
        model(
            inputs["latents"][0],
            torch.full((2,), 0.8),
            inputs["text"],
            attention=SDPAImpl(),
            metadata=blocks,
            cache=cache,
            parallel=layout,
        )
    kept = [cache.layer(i, blocks) for i in range(qwen_workers.TINY.num_layers)]
    return [
        (x.is_contiguous(), x.untyped_storage().nbytes(), x.numel() * x.element_size())
        for pair in kept
        for x in pair
    ]


def test_the_prefix_cache_keeps_its_keys_and_values_not_the_exchange_buffer():
    """k/v leave the exchange as views beside q; the cache must copy them out, else every layer's whole
    received buffer (q included: 1.5x the cache) stays alive for the request."""
    stored = parallel_workers.run_forked(prefix_cache_storage, ParallelConfig(sp=2))
    assert len(stored) == 2 * qwen_workers.TINY.num_layers
    assert all(contiguous and storage == values for contiguous, storage, values in stored), stored
