"""Check the mmgen.kernels references against the real FA3 / FA4 / FlashInfer kernels on CUDA (bf16).

Each case builds one randomized layout (GQA 8/2, head_dim 128, scattered pages, windows shorter than
the prefixes, softcap), runs the real kernel in bf16 through the same provider object the backends use,
and the reference in fp32 on the same values, then prints: kernel | case | max abs err of out | of LSE.
A case passes at max abs <= 2e-2. Libraries that are not installed are skipped with a note; features a
build lacks (fa3-fwd 0.0.3 has no paged KV and no sliding window) are skipped the same way.

FlashInfer JIT-compiles a module per kernel variant on first use (1-2 minutes each with nvcc), so every
FlashInfer case here uses one variant: bf16, head_dim 128, sliding window on, softcap on, backend "fa2"
(tensor-core decode reuses the prefill module); merge_state adds the cascade module. Set
FLASHINFER_WORKSPACE_BASE to a kept directory to reuse the builds across runs.

Run from the repository root, with the GPU packages on PYTHONPATH (benchmarks/README.md says how):
    python3 benchmarks/gpu_kernels_check.py [--only fa3,fa4,flashinfer] [--decode-cuda-cores]
Exit status: 0 when every case that ran passed, 1 otherwise, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mmgen import kernels as fa
from mmgen.kernels import flashinfer as fi
from mmgen.kernels import flashinfer_providers as fip

HQ, HK, D = 8, 2, 128
TOLERANCE = 2e-2
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Result:
    """One table row."""

    kernel: str
    case: str
    out_err: float | None
    lse_err: float | None
    note: str = ""

    @property
    def passed(self) -> bool:
        errs = [e for e in (self.out_err, self.lse_err) if e is not None]
        return not self.note.startswith("ERROR") and all(e <= TOLERANCE for e in errs) and bool(errs)


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs difference over entries where the reference is finite (-inf LSE rows must match too)."""
    got, want = got.float(), want.float()
    if not torch.equal(torch.isneginf(got), torch.isneginf(want)):
        return float("inf")
    finite = torch.isfinite(want)
    return float((got[finite] - want[finite]).abs().max()) if finite.any() else 0.0


class Layout:
    """A paged K/V pool (finite random values everywhere) with per-request pages scattered at random."""

    def __init__(self, lengths: list[int], page_size: int, gen: torch.Generator, device: str) -> None:
        self.lengths, self.page_size = lengths, page_size
        pages_per = [math.ceil(n / page_size) for n in lengths]
        num_pages = sum(pages_per) + 4
        self.device = device
        self.k = torch.randn(num_pages, page_size, HK, D, generator=gen).to(device, DTYPE)
        self.v = torch.randn(num_pages, page_size, HK, D, generator=gen).to(device, DTYPE)
        perm = torch.randperm(num_pages, generator=gen).tolist()
        table = torch.full((len(lengths), max(pages_per) + 1), perm[-1], dtype=torch.int32)
        self.rows = []
        for b, count in enumerate(pages_per):
            row = [perm.pop() for _ in range(count)]
            table[b, :count] = torch.tensor(row, dtype=torch.int32)
            self.rows.append(row)
        self.page_table = table.to(device)
        self.seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)

    def fp32(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.float(), self.v.float()

    def flashinfer_args(self, lengths: list[int], first_page: list[int] | None = None):
        """(indptr, indices, last_page_len) for `lengths` tokens per request starting at page first_page[b]."""
        first_page = first_page or [0] * len(lengths)
        counts, indices, last = [0], [], []
        for row, start, n in zip(self.rows, first_page, lengths, strict=True):
            pages = row[start : start + math.ceil(n / self.page_size)]
            counts.append(counts[-1] + len(pages))
            indices += pages
            last.append(n - (len(pages) - 1) * self.page_size if pages else self.page_size)
        as_int = lambda xs: torch.tensor(xs, dtype=torch.int32, device=self.device)  # noqa: E731
        return as_int(counts), as_int(indices), as_int(last)


def cu(lengths: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def randn(*shape: int, gen: torch.Generator, device: str) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device, DTYPE)


def random_extend(gen: torch.Generator, batch: int, max_prefix: int) -> tuple[list[int], list[int]]:
    q_lens = torch.randint(1, 24, (batch,), generator=gen).tolist()
    prefixes = torch.randint(0, max_prefix + 1, (batch,), generator=gen).tolist()
    prefixes[0] = 0
    prefixes[-1] = max_prefix
    return q_lens, prefixes


def run_case(kernel: str, case: str, fn: Callable[[], tuple]) -> Result:
    try:
        out, lse, ref_out, ref_lse = fn()
        if out.is_cuda:
            torch.cuda.synchronize()
    except Exception as err:  # a table row per failure, then go on with the other cases
        return Result(
            kernel, case, None, None, f"ERROR {type(err).__name__}: {str(err).splitlines()[0][:90]}"
        )
    lse_err = max_err(lse, ref_lse) if lse is not None else None
    return Result(kernel, case, max_err(out, ref_out), lse_err)


# ---------------------------------------------------------------------------------------------------
# FlashAttention (FA3 / FA4 through the provider objects)


def flash_attention_cases(provider, gen: torch.Generator, dev: str) -> list[tuple[str, Callable[[], tuple]]]:
    ref = fa.ReferenceFlashAttention()
    cases: list[tuple[str, Callable[[], tuple]]] = []

    def ragged(window: tuple[int, int]) -> tuple:
        q_lens, prefixes = random_extend(gen, 5, 200)
        k_lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
        q = randn(sum(q_lens), HQ, D, gen=gen, device=dev)
        k, v = randn(sum(k_lens), HK, D, gen=gen, device=dev), randn(sum(k_lens), HK, D, gen=gen, device=dev)
        call = dict(cu_seqlens_q=cu(q_lens, dev), cu_seqlens_k=cu(k_lens, dev), max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens), causal=True, window_size=window, softcap=30.0, return_lse=True)  # fmt: skip
        out, lse = provider.flash_attn_varlen_func(q, k, v, **call)
        ref_out, ref_lse = ref.flash_attn_varlen_func(q.float(), k.float(), v.float(), **call)
        return out, lse, ref_out, ref_lse

    def contiguous_decode(with_metadata: bool) -> tuple:
        batch, cap = 6, 512
        k_cache, v_cache = (
            randn(batch, cap, HK, D, gen=gen, device=dev),
            randn(batch, cap, HK, D, gen=gen, device=dev),
        )
        seqlens = torch.randint(1, cap, (batch,), generator=gen).to(dev, torch.int32)
        q = randn(batch, 1, HQ, D, gen=gen, device=dev)
        call = dict(cache_seqlens=seqlens, causal=True, softcap=30.0, return_softmax_lse=True)
        md = dict(qkv_dtype=DTYPE, causal=True, has_softcap=True)
        real_md = (
            provider.get_scheduler_metadata(batch, 1, cap, HQ, HK, D, seqlens, **md)
            if with_metadata
            else None
        )
        ref_md = (
            ref.get_scheduler_metadata(batch, 1, cap, HQ, HK, D, seqlens, **md) if with_metadata else None
        )
        out, lse = provider.flash_attn_with_kvcache(q, k_cache, v_cache, scheduler_metadata=real_md, **call)
        ref_out, ref_lse = ref.flash_attn_with_kvcache(q.float(), k_cache.float(), v_cache.float(), scheduler_metadata=ref_md, **call)  # fmt: skip
        return out, lse, ref_out, ref_lse

    def contiguous_extend_append() -> tuple:
        batch, cap = 4, 320
        k_cache, v_cache = (
            randn(batch, cap, HK, D, gen=gen, device=dev),
            randn(batch, cap, HK, D, gen=gen, device=dev),
        )
        ref_k, ref_v = k_cache.float(), v_cache.float()
        cached = torch.randint(0, 250, (batch,), generator=gen).to(dev, torch.int32)
        new = 5
        q = randn(batch, new, HQ, D, gen=gen, device=dev)
        k_new, v_new = (
            randn(batch, new, HK, D, gen=gen, device=dev),
            randn(batch, new, HK, D, gen=gen, device=dev),
        )
        call = dict(cache_seqlens=cached, causal=True, return_softmax_lse=True)
        out, lse = provider.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **call)
        ref_out, ref_lse = ref.flash_attn_with_kvcache(
            q.float(), ref_k, ref_v, k_new.float(), v_new.float(), **call
        )
        if max_err(k_cache, ref_k) > 0 or max_err(v_cache, ref_v) > 0:
            raise AssertionError("the appended cache contents differ from the reference's")
        return out, lse, ref_out, ref_lse

    def paged(page_size: int, *, decode: bool, causal: bool, window: tuple[int, int]) -> tuple:
        batch = 8
        q_lens, prefixes = random_extend(gen, batch, 300)
        if decode:
            q_lens = [1] * batch
        lengths = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
        layout = Layout(lengths, page_size, gen, dev)
        call = dict(cache_seqlens=layout.seqlens, page_table=layout.page_table, causal=causal, window_size=window, softcap=30.0, return_softmax_lse=True)  # fmt: skip
        if decode:
            q = randn(batch, 1, HQ, D, gen=gen, device=dev)
        else:
            q = randn(sum(q_lens), HQ, D, gen=gen, device=dev)
            call.update(cu_seqlens_q=cu(q_lens, dev), max_seqlen_q=max(q_lens))
        out, lse = provider.flash_attn_with_kvcache(q, layout.k, layout.v, **call)
        ref_out, ref_lse = ref.flash_attn_with_kvcache(q.float(), *layout.fp32(), **call)
        return out, lse, ref_out, ref_lse

    def paged_varlen(page_size: int) -> tuple:
        q_lens, prefixes = random_extend(gen, 6, 300)
        lengths = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
        layout = Layout(lengths, page_size, gen, dev)
        q = randn(sum(q_lens), HQ, D, gen=gen, device=dev)
        call = dict(cu_seqlens_q=cu(q_lens, dev), max_seqlen_q=max(q_lens), seqused_k=layout.seqlens, page_table=layout.page_table, causal=True, window_size=(63, 0), softcap=30.0, return_lse=True)  # fmt: skip
        out, lse = provider.flash_attn_varlen_func(q, layout.k, layout.v, **call)
        ref_out, ref_lse = ref.flash_attn_varlen_func(q.float(), *layout.fp32(), **call)
        return out, lse, ref_out, ref_lse

    cases.append(("varlen ragged causal softcap", lambda: ragged((-1, -1))))
    cases.append(("kvcache contiguous decode", lambda: contiguous_decode(False)))
    cases.append(("kvcache contiguous decode + scheduler_metadata", lambda: contiguous_decode(True)))
    cases.append(("kvcache contiguous extend, append k/v", contiguous_extend_append))
    if provider.supports_window:
        cases.append(("varlen ragged causal window 63 softcap", lambda: ragged((63, 0))))
    if provider.supports_paged_kv:
        for ps in (1, 16):
            window = (63, 0) if provider.supports_window else (-1, -1)
            cases.append((f"kvcache paged decode p{ps} window softcap", lambda ps=ps, w=window: paged(ps, decode=True, causal=True, window=w)))  # fmt: skip
            cases.append((f"kvcache paged extend p{ps} window softcap", lambda ps=ps, w=window: paged(ps, decode=False, causal=True, window=w)))  # fmt: skip
            cases.append((f"kvcache paged cross (non-causal) p{ps}", lambda ps=ps: paged(ps, decode=False, causal=False, window=(-1, -1))))  # fmt: skip
            cases.append((f"varlen page_table+seqused_k p{ps} window", lambda ps=ps: paged_varlen(ps)))
    return cases


# ---------------------------------------------------------------------------------------------------
# FlashInfer: one kernel variant (bf16, head_dim 128, window on, softcap on, fa2)

FI_WINDOW, FI_SOFTCAP = 48, 30.0


def flashinfer_cases(
    lib, decode_cuda_cores: bool, gen: torch.Generator, dev: str
) -> list[tuple[str, Callable[[], tuple]]]:
    ref = fip.ReferenceFlashInfer()
    workspace = torch.zeros(128 * 1024 * 1024 if dev == "cuda" else 16, dtype=torch.uint8, device=dev)
    ref_ws = torch.empty(0, dtype=torch.uint8, device=dev)
    variant = dict(window_left=FI_WINDOW, logits_soft_cap=FI_SOFTCAP)

    def decode(page_size: int, tensor_cores: bool) -> tuple:
        batch = 8
        lengths = torch.randint(1, 400, (batch,), generator=gen).tolist()
        layout = Layout(lengths, page_size, gen, dev)
        q = randn(batch, HQ, D, gen=gen, device=dev)
        args = (*layout.flashinfer_args(lengths), HQ, HK, D, page_size)
        real = lib.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=tensor_cores, backend="fa2"
        )
        real.plan(*args, q_data_type=DTYPE, **variant)
        out, lse = real.run(q, (layout.k, layout.v), return_lse=True)
        mine = ref.BatchDecodeWithPagedKVCacheWrapper(ref_ws, "NHD", use_tensor_cores=tensor_cores)
        mine.plan(*args, q_data_type=torch.float32, **variant)
        ref_out, ref_lse = mine.run(q.float(), layout.fp32(), return_lse=True)
        return out, lse, ref_out, ref_lse

    def extend_parts(page_size: int):
        """Ragged new tokens (causal) and the trimmed paged prefix (custom mask), real and reference."""
        q_lens, prefixes = random_extend(gen, 6, 200)
        lengths = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
        layout = Layout(lengths, page_size, gen, dev)
        q = randn(sum(q_lens), HQ, D, gen=gen, device=dev)
        keys = [fa.gather_paged(layout.k, layout.page_table[b], n) for b, n in enumerate(lengths)]
        values = [fa.gather_paged(layout.v, layout.page_table[b], n) for b, n in enumerate(lengths)]
        new_k = torch.cat([k[p:] for k, p in zip(keys, prefixes, strict=True)])
        new_v = torch.cat([v[p:] for v, p in zip(values, prefixes, strict=True)])
        first_page, kept, masks = [], [], []
        for p, n in zip(prefixes, q_lens, strict=True):
            start_page = max(0, p - FI_WINDOW) // page_size
            first_page.append(start_page)
            kept.append(p - start_page * page_size)
            key_pos = torch.arange(start_page * page_size, p, device=dev)[None, :]
            query_pos = torch.arange(p, p + n, device=dev)[:, None]
            masks.append((key_pos >= query_pos - FI_WINDOW).reshape(-1))
        qo = cu(q_lens, dev)
        paged_args = (qo, *layout.flashinfer_args(kept, first_page), HQ, HK, D, page_size)
        parts = {}
        for name, provider, dtype, ws in (
            ("real", lib, DTYPE, workspace),
            ("ref", ref, torch.float32, ref_ws),
        ):
            cast = (lambda t: t) if name == "real" else (lambda t: t.float())  # noqa: E731
            backend = dict(backend="fa2") if name == "real" else {}
            ragged = provider.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", **backend)
            ragged.plan(qo, qo, HQ, HK, D, causal=True, q_data_type=dtype, **variant)
            o_new, s_new = ragged.run(cast(q), cast(new_k), cast(new_v), return_lse=True)
            prefix = provider.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", **backend)
            prefix.plan(*paged_args, custom_mask=torch.cat(masks), causal=False, q_data_type=dtype, **variant)
            o_pre, s_pre = prefix.run(cast(q), (cast(layout.k), cast(layout.v)), return_lse=True)
            parts[name] = (o_new, s_new, o_pre, s_pre)
        whole = fa.ReferenceFlashAttention().flash_attn_with_kvcache(
            q.float(),
            *layout.fp32(),
            cache_seqlens=layout.seqlens,
            page_table=layout.page_table,
            cu_seqlens_q=qo,
            max_seqlen_q=max(q_lens),
            causal=True,
            window_size=(FI_WINDOW, 0),
            softcap=FI_SOFTCAP,
            return_softmax_lse=True,
        )
        return parts, whole

    def ragged_case(page_size: int) -> tuple:
        parts, _ = extend_parts(page_size)
        return parts["real"][0], parts["real"][1], parts["ref"][0], parts["ref"][1]

    def paged_mask_case(page_size: int) -> tuple:
        parts, _ = extend_parts(page_size)
        return parts["real"][2], parts["real"][3], parts["ref"][2], parts["ref"][3]

    def merged_case(page_size: int) -> tuple:
        parts, (whole_out, whole_lse) = extend_parts(page_size)
        o_new, s_new, o_pre, s_pre = parts["real"]
        out, lse = lib.merge_state(o_pre, s_pre, o_new, s_new)
        return out, lse, whole_out, whole_lse.T * fi.LOG2E  # whole attention, FA natural LSE -> base 2

    def paged_causal(page_size: int) -> tuple:
        q_lens, prefixes = random_extend(gen, 6, 200)
        lengths = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
        layout = Layout(lengths, page_size, gen, dev)
        q = randn(sum(q_lens), HQ, D, gen=gen, device=dev)
        args = (cu(q_lens, dev), *layout.flashinfer_args(lengths), HQ, HK, D, page_size)
        real = lib.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
        real.plan(*args, causal=True, q_data_type=DTYPE, **variant)
        out, lse = real.run(q, (layout.k, layout.v), return_lse=True)
        mine = ref.BatchPrefillWithPagedKVCacheWrapper(ref_ws, "NHD")
        mine.plan(*args, causal=True, q_data_type=torch.float32, **variant)
        ref_out, ref_lse = mine.run(q.float(), layout.fp32(), return_lse=True)
        return out, lse, ref_out, ref_lse

    cases = [
        ("decode p16 (tensor cores)", lambda: decode(16, True)),
        ("decode p1 (tensor cores)", lambda: decode(1, True)),
        ("ragged prefill causal", lambda: ragged_case(16)),
        ("paged prefix, custom window mask p16", lambda: paged_mask_case(16)),
        ("paged prefix, custom window mask p1", lambda: paged_mask_case(1)),
        ("paged prefill causal p16", lambda: paged_causal(16)),
        ("merge_state(paged prefix, ragged) = whole p16", lambda: merged_case(16)),
        ("merge_state(paged prefix, ragged) = whole p1", lambda: merged_case(1)),
    ]
    if decode_cuda_cores:
        cases.append(("decode p16 (CUDA cores)", lambda: decode(16, False)))
    return cases


# ---------------------------------------------------------------------------------------------------


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def _load(name: str, self_test: bool):
    """(label, provider) for one library; the references stand in for every library under --self-test."""
    if self_test:
        if name == "flashinfer":
            return "reference as flashinfer", fip.ReferenceFlashInfer()
        return f"reference as {name}", fa.ReferenceFlashAttention()
    if name == "flashinfer":
        return f"flashinfer {_version('flashinfer-python')}", fip.load_flashinfer_provider("flashinfer")
    provider = fa.load_flash_attention_provider(name)
    if name == "fa3":
        dist = "fa3-fwd" if provider.module == "fa3_fwd_interface" else "flash-attn-3"
        return f"fa3 {provider.module} {_version(dist)}", provider
    return f"fa4 flash_attn.cute {_version('flash-attn-4')}", provider


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="fa3,fa4,flashinfer", help="comma list of fa3, fa4, flashinfer")
    parser.add_argument("--decode-cuda-cores", action="store_true", help="also check non-tensor-core decode (one more JIT module)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--self-test", action="store_true", help="run the harness with the references on both sides (CPU)")  # fmt: skip
    args = parser.parse_args()
    if args.self_test:
        dev = "cpu"
        print("self-test: the references stand in for the real kernels, on CPU")
    elif not torch.cuda.is_available():
        print("gpu_kernels_check: needs CUDA; nothing run")
        return 2
    else:
        dev = "cuda"
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  CUDA {torch.version.cuda}")
    results: list[Result] = []
    notes: list[str] = []
    for name in [n.strip() for n in args.only.split(",") if n.strip()]:
        gen = torch.Generator().manual_seed(args.seed)
        started = time.perf_counter()
        try:
            label, provider = _load(name, args.self_test)
        except fa.KernelUnavailableError as err:
            notes.append(f"{name}: skipped ({err})")
            continue
        if name == "flashinfer":
            cases = flashinfer_cases(provider, args.decode_cuda_cores, gen, dev)
        else:
            if not provider.supports_paged_kv:
                notes.append(f"{name}: this build has no paged KV; paged cases skipped")
            if not provider.supports_window:
                notes.append(f"{name}: this build has no sliding window; window cases skipped")
            cases = flash_attention_cases(provider, gen, dev)
        for case, fn in cases:
            results.append(run_case(label, case, fn))
        notes.append(
            f"{name}: {len(cases)} cases in {time.perf_counter() - started:.1f} s (first calls include JIT)"
        )
    fmt = lambda e: "-" if e is None else f"{e:.2e}"  # noqa: E731
    width = max([len(r.kernel) for r in results] + [6])
    print(f"\n{'kernel':<{width}} | {'case':<46} | {'out max abs':>11} | {'lse max abs':>11} | result")
    print("-" * (width + 90))
    for r in results:
        verdict = "ok" if r.passed else ("FAIL " + r.note).strip()
        print(f"{r.kernel:<{width}} | {r.case:<46} | {fmt(r.out_err):>11} | {fmt(r.lse_err):>11} | {verdict}")
    print(
        f"\ntolerance: max abs <= {TOLERANCE:g} (real kernel in bf16 vs the fp32 reference on the same values)"
    )
    for note in notes:
        print(f"note: {note}")
    return 0 if results and all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
