"""GPU check of the LLM backends: flash_attention (FA3/FA4) and flashinfer on the real kernels, bf16.

Run from the repository root on a CUDA machine, GPU packages on PYTHONPATH (benchmarks/README.md):

    python3 benchmarks/gpu_llm_check.py [--skip-flashinfer] [--budget-s 330]

Phases (each prints as it goes; a compact table at the end; exit 0 when every row that ran passed):
1. backends   every mode (EXTEND, DECODE, MIXED, TARGET_VERIFY, DRAFT_EXTEND_V2) x page size 1/16,
              GQA 8/2, head_dim 128, softcap, windows shorter than the prefixes, every encoder length
              different: each layer's output vs torch_native in fp32 on the same (bf16-rounded)
              values; pass at max abs <= 2e-2.
2. greedy     a tiny T5Gemma (bf16, head_dim 128) generates 6 prompts of different lengths on
              torch_native, flash_attention and flashinfer: the tokens must be equal.
3. graphs     Engine(cuda_graph_batch_sizes=...) vs the eager engine per fast backend: equal tokens,
              logits within 2e-2 (runner captures buckets 1, 2, 4, 8).
4. speculative  target + a noisy draft: output equals the same backend's greedy engine output;
              acceptance rate reported.
FlashInfer builds its JIT modules on first use (about 1-2 minutes each); every FlashInfer call here
uses bf16, head_dim 128, softcap on, kernel backend "fa2" and tensor-core decode (so decode reuses the
prefill modules): the sliding and the non-sliding variant plus merge_state. FLASHINFER_WORKSPACE_BASE
defaults to .gpu/flashinfer_workspace in the repository (keep it to skip rebuilding). Phases past
--budget-s seconds are skipped and reported as such.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the randomized batch helpers the CPU tests use
os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(ROOT / ".gpu" / "flashinfer_workspace"))

import torch  # noqa: E402
from llm_backend_cases import make_case, random_prompts, tiny_t5gemma  # noqa: E402

from mmgen.errors import MmgenError  # noqa: E402
from mmgen.llm.backends.torch_native import TorchNativeBackend  # noqa: E402
from mmgen.llm.engine import Engine, EngineConfig  # noqa: E402
from mmgen.llm.forward_batch import ForwardMode  # noqa: E402
from mmgen.llm.memory import KVPool  # noqa: E402
from mmgen.llm.sampling import SamplingParams  # noqa: E402
from mmgen.llm.speculative import ModelSession, SpeculativeDecoder  # noqa: E402

TOLERANCE = 2e-2
DEVICE = "cuda"  # --cpu-smoke: the same phases on CPU through the kernel references (a dry run)
MODES = [
    ForwardMode.EXTEND,
    ForwardMode.DECODE,
    ForwardMode.MIXED,
    ForwardMode.TARGET_VERIFY,
    ForwardMode.DRAFT_EXTEND_V2,
]
FLASHINFER_OPTIONS = {"kernel_backend": "fa2", "use_tensor_cores": True}


@dataclass
class Row:
    phase: str
    backend: str
    case: str
    value: str
    passed: bool | None  # None = skipped

    def show(self) -> str:
        mark = {True: "ok", False: "FAIL", None: "skip"}[self.passed]
        return f"{self.phase:<12} {self.backend:<26} {self.case:<34} {self.value:<34} {mark}"


def backend_options(name: str) -> dict:
    return dict(FLASHINFER_OPTIONS) if name == "flashinfer" else {}


def fp32_copy(pool: KVPool) -> KVPool:
    """The same pool with fp32 buffers holding the bf16 values (the reference's inputs)."""
    ref = copy.copy(pool)
    ref.dtype = torch.float32
    ref.k_buffers = [b.float() for b in pool.k_buffers]
    ref.v_buffers = [b.float() for b in pool.v_buffers]
    return ref


def run_case_layers(backend, case, q, k, v) -> list[torch.Tensor]:
    backend.init_forward_metadata(case.batch)
    outs = []
    for layer in case.layers:
        kv = (None, None) if layer.is_cross_attention else (k, v)
        outs.append(backend.forward(q, *kv, layer, case.batch, save_kv_cache=not layer.is_cross_attention))
    return outs


def phase_backends(rows: list[Row], names: list[str]) -> None:
    from mmgen.llm.backends import make_backend

    for name in names:
        for mode in MODES:
            for ps in (1, 16):
                label = f"{mode.name} page {ps}"
                try:
                    bs = 16 if ps == 1 else 7
                    case = make_case(
                        mode, seed=ps + len(label), batch_size=bs, page_size=ps, window=32, num_q_heads=8,
                        num_kv_heads=2, head_dim=128, softcap=50.0, dtype=torch.bfloat16, device=DEVICE, max_encoder=200,
                    )  # fmt: skip
                    ref_pool = fp32_copy(case.kv_pool)
                    want = run_case_layers(
                        TorchNativeBackend(case.req_pool, ref_pool),
                        case,
                        case.q.float(),
                        case.k.float(),
                        case.v.float(),
                    )
                    backend = make_backend(
                        name, case.req_pool, case.kv_pool, case.layers, **backend_options(name)
                    )
                    got = run_case_layers(backend, case, case.q, case.k, case.v)
                    err = max((g.float() - w).abs().max().item() for g, w in zip(got, want, strict=True))
                    provider = getattr(backend.provider, "name", "?")
                    rows.append(
                        Row("backends", f"{name}/{provider}", label, f"max abs {err:.2e}", err <= TOLERANCE)
                    )
                except Exception as exc:  # a row per failure; the other cases still run
                    rows.append(
                        Row("backends", name, label, f"ERROR {type(exc).__name__}: {exc}"[:60], False)
                    )
                    traceback.print_exc()
                print(rows[-1].show(), flush=True)


def tiny_model():
    return tiny_t5gemma(seed=1, window=4, hidden=256, heads=4, kv_heads=2, head_dim=128).to(
        DEVICE, torch.bfloat16
    )


PROMPTS = random_prompts(3, [3, 13, 5, 9, 7, 11])
STEPS = 12


def engine_tokens(model, name: str, **config) -> tuple[list[list[int]], torch.Tensor]:
    cfg = EngineConfig(max_kv_tokens=2048, page_size=16, max_context_len=64, backend=name, **config)
    engine = Engine(model, cfg, backend_options=backend_options(name))
    outs = engine.generate(
        PROMPTS, SamplingParams(max_new_tokens=STEPS, stop_token_ids=(), return_logits=True)
    )
    return [o.token_ids for o in outs], torch.stack([o.logits for o in outs])


def first_mismatch(a: list[list[int]], b: list[list[int]], logits: torch.Tensor) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for j, (s, t) in enumerate(zip(x, y, strict=True)):
            if s != t:
                top = logits[i, j].float().topk(2).values
                return f"req {i} step {j}: {s} vs {t} (top-2 gap {float(top[0] - top[1]):.3f})"
    return "equal"


def phase_greedy(rows: list[Row], names: list[str], model, reference: dict) -> None:
    base, base_logits = engine_tokens(model, "torch_native")
    reference["torch_native"] = base
    for name in names:
        try:
            toks, logits = engine_tokens(model, name)
            reference[name] = toks
            err = (logits.float() - base_logits.float()).abs().max().item()
            same = toks == base
            detail = "tokens equal" if same else first_mismatch(toks, base, base_logits)
            rows.append(
                Row("greedy", name, "6 prompts x 12 tokens", f"{detail}; logits {err:.1e}"[:34], same)
            )
        except Exception as exc:
            rows.append(
                Row("greedy", name, "6 prompts x 12 tokens", f"ERROR {type(exc).__name__}: {exc}"[:60], False)
            )
            traceback.print_exc()
        print(rows[-1].show(), flush=True)


def phase_graphs(rows: list[Row], names: list[str], model) -> None:
    for name in names:
        try:
            eager, eager_logits = engine_tokens(model, name)
            graphed, graph_logits = engine_tokens(model, name, cuda_graph_batch_sizes=(1, 2, 4, 8))
            err = (graph_logits.float() - eager_logits.float()).abs().max().item()
            ok = graphed == eager and err <= TOLERANCE
            rows.append(
                Row(
                    "graphs",
                    name,
                    "engine, buckets 1/2/4/8",
                    f"tokens {'equal' if graphed == eager else 'DIFFER'}; logits {err:.1e}",
                    ok,
                )
            )
        except MmgenError as exc:  # a refusal, e.g. the reference kernels cannot be captured
            print(f"graphs {name}: {exc}", flush=True)
            rows.append(Row("graphs", name, "engine, buckets 1/2/4/8", "refused (see above)", None))
        except Exception as exc:
            rows.append(
                Row(
                    "graphs",
                    name,
                    "engine, buckets 1/2/4/8",
                    f"ERROR {type(exc).__name__}: {exc}"[:60],
                    False,
                )
            )
            traceback.print_exc()
        print(rows[-1].show(), flush=True)


def phase_speculative(rows: list[Row], names: list[str], model, reference: dict) -> None:
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in draft.parameters():
            p.mul_(1 + 0.1 * torch.randn(p.shape, generator=gen).to(p.device, p.dtype))
    for name in names:
        try:
            kw = dict(
                backend=name,
                page_size=16,
                max_context=64,
                max_kv_tokens=2048,
                backend_options=backend_options(name),
            )
            result = SpeculativeDecoder(ModelSession(model, **kw), ModelSession(draft, **kw), 3).generate(
                PROMPTS, STEPS
            )
            want = reference.get(name) or engine_tokens(model, name)[0]
            ok = result.token_ids == want
            value = f"{'= greedy' if ok else 'DIFFERS'}; accept {result.acceptance_rate:.2f}"
            rows.append(Row("speculative", name, f"k=3, {result.target_steps} target steps", value, ok))
        except Exception as exc:
            rows.append(Row("speculative", name, "k=3", f"ERROR {type(exc).__name__}: {exc}"[:60], False))
            traceback.print_exc()
        print(rows[-1].show(), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-flashinfer", action="store_true")
    parser.add_argument("--budget-s", type=float, default=330.0, help="skip phases that would start later")
    parser.add_argument("--cpu-smoke", action="store_true", help="dry run on CPU through the references")
    args = parser.parse_args()
    global DEVICE
    if args.cpu_smoke:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing to check (--cpu-smoke runs the phases on CPU)")
        return 2
    start = time.perf_counter()
    names = ["flash_attention"] + ([] if args.skip_flashinfer else ["flashinfer"])
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (references)"
    print(f"device {gpu}, torch {torch.__version__}, backends {names}", flush=True)
    rows: list[Row] = []
    reference: dict = {}
    model = tiny_model()
    phases = [
        ("backends", lambda: phase_backends(rows, names)),
        ("greedy", lambda: phase_greedy(rows, names, model, reference)),
        ("graphs", lambda: phase_graphs(rows, names, model)),
        ("speculative", lambda: phase_speculative(rows, names, model, reference)),
    ]
    for phase, run in phases:
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            rows.append(Row(phase, "-", "-", f"skipped at {elapsed:.0f} s", None))
            continue
        t0 = time.perf_counter()
        run()
        print(f"-- {phase}: {time.perf_counter() - t0:.1f} s", flush=True)
    print("\n" + f"{'phase':<12} {'backend':<26} {'case':<34} {'result':<34} ok")
    for row in rows:
        print(row.show())
    ran = [r for r in rows if r.passed is not None]
    failed = [r for r in ran if not r.passed]
    print(
        f"\n{len(ran) - len(failed)}/{len(ran)} passed, {len(rows) - len(ran)} skipped, {time.perf_counter() - start:.0f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
