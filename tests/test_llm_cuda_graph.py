"""CUDA-graph capture/replay: replay metadata == eager metadata in every mode, and graph decode == eager.

On CPU there are no graphs: the capture/replay METADATA path runs on the backends' static buffers
(capture with one random batch, replay another of the same size, compare with the eager metadata of
the replayed batch), and the runner's padded replay path runs eagerly. The real graph capture runs
only with CUDA.
"""

from __future__ import annotations

import pytest
import torch
from llm_backend_cases import make_case, random_prompts, run_layers, tiny_t5gemma

from mmgen.kernels import ReferenceFlashAttention, ReferenceFlashInfer, describe_scheduler_metadata
from mmgen.llm.backends.flash_attention import FlashAttentionBackend
from mmgen.llm.backends.flash_metadata import metadata_tensors
from mmgen.llm.backends.flashinfer import FlashInferBackend
from mmgen.llm.cuda_graph_runner import CudaGraphRunner
from mmgen.llm.forward_batch import ForwardMode
from mmgen.llm.speculative import ModelSession, build_batch

MODES = [
    ForwardMode.DECODE,
    ForwardMode.EXTEND,
    ForwardMode.MIXED,
    ForwardMode.TARGET_VERIFY,
    ForwardMode.DRAFT_EXTEND_V2,
]


def _capture_batch(live):
    """A batch of the same mode, rows and token counts as live's, every encoder length different from
    live's (rotated): what a capture leaves in the static buffers differs in every row."""
    b = live.batch
    enc = live.encoder_lens[1:] + live.encoder_lens[:1]
    spec = b.spec_info.draft_token_num if b.spec_info is not None else None
    rows = b.req_pool_indices.tolist()
    return build_batch(
        b.forward_mode, live.req_pool.req_to_token, rows, enc, live.prefix_lens, live.query_lens, spec
    )


def _assert_fa_live_rows(replay, eager):
    """replay (possibly padded to a larger batch) holds eager's metadata in its first eager.batch_size
    rows, exactly: per-request lengths, cu_seqlens prefixes, page-table rows (live columns equal, the
    rest zero) and the max lengths the kernels are called with."""
    assert replay.forward_mode == eager.forward_mode and replay.batch_size >= eager.batch_size
    for name in ("max_seq_len_q", "max_seq_len_k", "encoder_max_seq_len_k"):
        assert getattr(replay, name) == getattr(eager, name), name
    r_t, e_t = metadata_tensors(replay), metadata_tensors(eager)
    for name, want in e_t.items():
        got = r_t[name][: want.shape[0]]  # [B + 1] offsets, [B] lengths, [B, pages] tables
        if want.dim() == 2:  # static tables are wider: the live columns equal, the rest zero
            assert torch.equal(got[:, : want.shape[1]], want), name
            assert not bool(got[:, want.shape[1] :].any()), name
        else:
            assert torch.equal(got, want), name


def _assert_same_fa(replay, eager):
    assert replay.batch_size == eager.batch_size
    _assert_fa_live_rows(replay, eager)
    assert [s for s, _ in replay.scheduler_metadata] == [s for s, _ in eager.scheduler_metadata]
    for (_, got), (_, want) in zip(replay.scheduler_metadata, eager.scheduler_metadata, strict=True):
        assert describe_scheduler_metadata(got) == describe_scheduler_metadata(want)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ps", [1, 16])
def test_flash_replay_metadata_equals_eager(mode, ps):
    live = make_case(mode, seed=7 + ps, batch_size=6, page_size=ps)
    backend = FlashAttentionBackend(
        live.req_pool, live.kv_pool, live.layers, provider=ReferenceFlashAttention()
    )
    backend.init_forward_metadata(live.batch)
    eager = backend.metadata
    eager_out = run_layers(backend, live)
    backend.init_cuda_graph_state(8, 128)
    backend.init_forward_metadata_capture_cuda_graph(_capture_batch(live))
    backend.init_forward_metadata_replay_cuda_graph(live.batch)
    replay = backend.metadata
    _assert_same_fa(replay, eager)
    static = backend.static
    assert replay.page_table.data_ptr() == static.tables.data_ptr()
    # The graph reads the encoder lengths from the static buffer, where every one of the bs lengths was
    # copied (the capture left a different one in every row).
    enc = replay.encoder_lens_int32
    assert enc.untyped_storage().data_ptr() == static.lengths.untyped_storage().data_ptr()
    assert enc.tolist() == live.encoder_lens
    for layer, want in zip(live.layers, eager_out, strict=True):
        kv = (None, None) if layer.is_cross_attention else (live.k, live.v)
        got = backend.forward(live.q, *kv, layer, live.batch, save_kv_cache=not layer.is_cross_attention)
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def _fi_static_equal(backend, eager):
    """What the graph-mode wrappers read after the replay's plans: the eager metadata, in every buffer
    (in the first eager.batch_size rows when the replayed batch was padded to a larger bucket)."""
    static, bs = backend.static, eager.batch_size
    layouts = {"full": eager.full.paged, "cross": eager.cross}
    if eager.sliding is not None:
        layouts["sliding"] = eager.sliding.paged
    for name, want in layouts.items():
        if want is None:
            continue
        buf = static.layouts[name]
        assert torch.equal(buf.indptr[: bs + 1], want.indptr), name
        assert torch.equal(buf.last_page_len[:bs], want.last_page_len), name
        assert torch.equal(buf.indices[: want.indices.numel()], want.indices), name
    if not eager.is_decode:
        assert torch.equal(static.qo_indptr[: bs + 1], eager.qo_indptr)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ps", [1, 16])
def test_flashinfer_replay_metadata_equals_eager(mode, ps):
    live = make_case(mode, seed=17 + ps, batch_size=5, page_size=ps)
    backend = FlashInferBackend(
        live.req_pool, live.kv_pool, live.layers, provider=ReferenceFlashInfer(), workspace_bytes=64
    )
    backend.init_forward_metadata(live.batch)
    eager = backend.metadata
    eager_out = run_layers(backend, live)
    backend.init_cuda_graph_state(8, 128)
    backend.init_forward_metadata_capture_cuda_graph(_capture_batch(live))
    backend.init_forward_metadata_replay_cuda_graph(live.batch)
    _fi_static_equal(backend, eager)
    assert backend.active is not backend.eager  # the bucket's graph-mode wrappers are planned
    for layer, want in zip(live.layers, eager_out, strict=True):
        kv = (None, None) if layer.is_cross_attention else (live.k, live.v)
        got = backend.forward(live.q, *kv, layer, live.batch, save_kv_cache=not layer.is_cross_attention)
        torch.testing.assert_close(got, want, atol=0, rtol=0)


# -- the runner on a tiny model ---------------------------------------------------------------------


def _decode_steps(session, allocs, steps, runner=None):
    """Prefill the start token, then greedy DECODE steps (through runner when given) -> logits per step."""
    n = len(allocs)
    logits = session.step(ForwardMode.EXTEND, allocs, [0] * n, [[0]] * n)
    tokens = logits.argmax(-1).tolist()
    out = [logits]
    for pos in range(1, steps):
        if runner is None:
            logits = session.step(ForwardMode.DECODE, allocs, [pos] * n, [[t] for t in tokens])
        else:
            logits = runner.replay(
                _decode_batch(session, allocs, pos), torch.tensor(tokens, dtype=torch.int64)
            )
        tokens = logits.argmax(-1).tolist()
        out.append(logits)
    return torch.stack(out)


def _decode_batch(session, allocs, pos):
    """The DECODE batch of allocs with pos cached decoder tokens each."""
    n = len(allocs)
    rows, enc = [a.row for a in allocs], [a.encoder_len for a in allocs]
    return build_batch(ForwardMode.DECODE, session.req_to_token, rows, enc, [pos] * n, [1] * n)


def _assert_replay_rows_equal_eager(backend, eager_meta):
    """After a padded replay's prepare: the static buffers hold the live batch's eager metadata."""
    if isinstance(backend, FlashInferBackend):
        _fi_static_equal(backend, eager_meta)
    else:
        assert backend.metadata.page_table.data_ptr() == backend.static.tables.data_ptr()
        _assert_fa_live_rows(backend.metadata, eager_meta)


@pytest.mark.parametrize("backend", ["flash_attention", "flashinfer"])
@pytest.mark.parametrize("n_requests", [3, 5])
def test_runner_replay_equals_eager_decode(backend, n_requests):
    """Padded replays (3 or 5 requests in buckets 4, 8) on static buffers, step by step against eager DECODE:
    - the static buffers hold the live batch's eager metadata in its rows (exactly: the kernels' inputs);
    - the logits equal an eager step of the same padded batch exactly (same shapes, same kernels);
    - the live rows' logits equal the unpadded eager step's within float tolerance: a GEMM over 4 or 8
      rows need not round like one over 3 on every CPU/GPU, so bitwise equality is no claim here.
    Both paths decode the eager path's greedy tokens, so a near-tie cannot fork them."""
    model = tiny_t5gemma(seed=3, window=3)
    prompts = random_prompts(4, [3, 11, 6, 9, 4][:n_requests])
    sessions, allocs = [], []
    for _ in range(2):
        session = ModelSession(model, backend=backend, page_size=16, max_context=64, max_kv_tokens=1024)
        sessions.append(session)
        allocs.append(session.admit(prompts, decoder_capacity=8))
    (eager, graphed), n = sessions, n_requests
    runner = CudaGraphRunner(model, graphed.backend, batch_sizes=(1, 2, 4, 8), use_cuda_graph=False)
    runner.capture()
    bs = runner.bucket(n)
    assert bs in (4, 8)
    logits = [
        s.step(ForwardMode.EXTEND, a, [0] * n, [[0]] * n) for s, a in zip(sessions, allocs, strict=True)
    ]
    torch.testing.assert_close(logits[1], logits[0], atol=0, rtol=0)  # the same eager computation twice
    for pos in range(1, 7):
        tokens = logits[0].argmax(-1)
        want = eager.step(ForwardMode.DECODE, allocs[0], [pos] * n, [[t] for t in tokens.tolist()])
        live = _decode_batch(graphed, allocs[1], pos)
        got = runner.replay(live, tokens)
        assert runner.bucket(live.batch_size) == bs
        _assert_replay_rows_equal_eager(graphed.backend, eager.backend.metadata)
        # The same padded batch run eagerly (fresh eager metadata, same static inputs): the same numbers.
        _, padded = runner.prepare(live, tokens)
        graphed.backend.init_forward_metadata(padded)
        with torch.inference_mode():
            hidden = model.decode(runner.input_ids[:bs], runner.positions[:bs], padded, graphed.backend)
            padded_eager = model.compute_logits(hidden)
        torch.testing.assert_close(got, padded_eager[:n], atol=0, rtol=0)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        logits = [want, got]


def test_runner_rejects_non_decode_and_torch_native():
    model = tiny_t5gemma(seed=3)
    session = ModelSession(model, backend="torch_native", page_size=16, max_context=64, max_kv_tokens=512)
    with pytest.raises(Exception, match="cannot run in CUDA graphs"):
        CudaGraphRunner(model, session.backend, use_cuda_graph=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["flash_attention", "flashinfer"])
def test_cuda_graph_decode_equals_eager_on_gpu(backend):
    """Real capture: graph replays give the eager step's logits (bf16 model, real or reference kernels)."""
    model = tiny_t5gemma(seed=3, window=3, head_dim=64, heads=4, kv_heads=2, hidden=128).to(
        "cuda", torch.bfloat16
    )
    prompts = random_prompts(4, [3, 11, 6, 9, 4])
    logits = []
    for use_runner in (False, True):
        session = ModelSession(model, backend=backend, page_size=16, max_context=64, max_kv_tokens=1024)
        allocs = session.admit(prompts, decoder_capacity=8)
        runner = None
        blocker = session.backend.cuda_graph_blocker()
        if blocker is not None:  # e.g. no paged FA kernel installed: the reference cannot be captured
            pytest.skip(blocker)
        if use_runner:
            runner = CudaGraphRunner(model, session.backend, batch_sizes=(1, 2, 4, 8))
            runner.capture()
        logits.append(_decode_steps(session, allocs, 7, runner).float())
    torch.testing.assert_close(logits[1], logits[0], atol=2e-2, rtol=0)
    assert torch.equal(logits[1].argmax(-1), logits[0].argmax(-1))


@pytest.mark.parametrize("backend", ["flash_attention", "flashinfer"])
def test_engine_with_graph_runner_matches_eager_engine(backend):
    """Engine(cuda_graph_batch_sizes=...): DECODE steps replay through the runner, MIXED ones run eagerly."""
    from mmgen.llm.engine import Engine, EngineConfig
    from mmgen.llm.sampling import SamplingParams

    model = tiny_t5gemma(seed=5, window=3)
    prompts = random_prompts(6, [3, 13, 5, 9, 7, 11])
    params = SamplingParams(max_new_tokens=7, stop_token_ids=(), return_logits=True)
    outs = []
    for cfg in (
        EngineConfig(max_kv_tokens=1024, page_size=16, max_context_len=64),
        EngineConfig(
            max_kv_tokens=1024,
            page_size=16,
            max_context_len=64,
            backend=backend,
            cuda_graph_batch_sizes=(1, 2, 4, 8),
        ),
    ):
        engine = Engine(model, cfg)
        replays = []
        if engine.runner.graph_runner is not None:
            graph_runner, replay = engine.runner.graph_runner, engine.runner.graph_runner.replay
            graph_runner.replay = lambda batch, ids, f=replay, log=replays: (
                log.append(batch.batch_size) or f(batch, ids)
            )
        ids = [engine.add_request(p, params) for p in prompts[:4]]
        done = {o.request_id: o for o in engine.step()}  # EXTEND, then 2 DECODE steps of 4 (bucket 4)
        for _ in range(2):
            done.update({o.request_id: o for o in engine.step()})
        ids += [engine.add_request(p, params) for p in prompts[4:]]  # MIXED, then DECODE of 6 (bucket 8)
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step()})
        outs.append([done[i] for i in ids])
        if cfg.cuda_graph_batch_sizes:
            assert replays[:2] == [4, 4] and 6 in replays  # DECODE steps went through the runner
    for eager, graphed in zip(*outs, strict=True):
        assert graphed.token_ids == eager.token_ids
        torch.testing.assert_close(graphed.logits, eager.logits, atol=1e-5, rtol=1e-5)
