"""Engine: continuous batching, greedy parity with transformers' generate, KV budget, abort, sampling."""

from __future__ import annotations

import pytest
import torch
from test_llm_tiny_model import WINDOW, build_tiny_t5gemma

from mmgen.errors import ValidationError
from mmgen.llm.backends import BACKEND_NAMES
from mmgen.llm.engine import Engine, EngineConfig
from mmgen.llm.models.t5gemma_loading import load_t5gemma
from mmgen.llm.sampling import SamplingParams, filter_logits

STEPS = 8  # decoder sequences longer than the sliding window
PROMPT_LENS = (3, 13, 5, 9, 7, 11)  # every request its own encoder length, most longer than the window
GREEDY = SamplingParams(max_new_tokens=STEPS, stop_token_ids=(), return_logits=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny checkpoint, our loaded model, 6 prompts and transformers' greedy tokens/logits for each."""
    directory = tmp_path_factory.mktemp("t5gemma_engine")
    hf = build_tiny_t5gemma(directory, seed=1)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    refs = []
    for prompt in prompts:
        out = hf.generate(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=STEPS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        refs.append((out.sequences[0, 1:].tolist(), torch.stack(out.logits)[:, 0]))
    assert WINDOW < STEPS
    return load_t5gemma(directory).model, prompts, refs


def _engine(model, page_size: int, max_kv_tokens: int = 512, **kw) -> Engine:
    return Engine(
        model, EngineConfig(max_kv_tokens=max_kv_tokens, page_size=page_size, max_context_len=64, **kw)
    )


def _assert_matches(out, ref):
    tokens, logits = ref
    assert out.token_ids == tokens
    assert out.finish_reason == "length"
    torch.testing.assert_close(out.logits, logits, atol=1e-4, rtol=0)


def _assert_all_free(engine: Engine):
    assert engine.num_free_pages() == engine.config.max_kv_tokens // engine.config.page_size
    assert engine.num_free_rows() == engine.config.max_running_requests
    assert not engine.has_unfinished()


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_batch_matches_transformers(setup, page_size):
    model, prompts, refs = setup
    engine = _engine(model, page_size)
    outputs = engine.generate(prompts, GREEDY)
    for out, ref in zip(outputs, refs, strict=True):
        _assert_matches(out, ref)
    _assert_all_free(engine)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_requests_join_mid_decode(setup, page_size, backend):
    """Three requests decode a few steps, then three more join: MIXED steps, same tokens and logits.

    Every registered backend runs it (flash_attention / flashinfer through the mmgen.kernels
    references on CPU)."""
    model, prompts, refs = setup
    engine = _engine(model, page_size, backend=backend)
    ids = [engine.add_request(p, GREEDY) for p in prompts[:3]]
    done = {}
    for _ in range(3):
        done.update({o.request_id: o for o in engine.step()})
    assert all(len(r.output_ids) == 3 for r in engine.scheduler.running)
    ids += [engine.add_request(p, GREEDY) for p in prompts[3:]]
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step()})
    for rid, ref in zip(ids, refs, strict=True):
        _assert_matches(done[rid], ref)
    _assert_all_free(engine)


def test_queueing_when_the_budget_is_full(setup):
    """A budget for two requests at a time: the rest wait, then run; results unchanged, memory freed."""
    model, prompts, refs = setup
    # Each request reserves 2 pages of 16 (prompt <= 16, 8 decoder tokens): 4 pages = 2 requests.
    engine = _engine(model, 16, max_kv_tokens=64)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done, max_running, saw_waiting = {}, 0, False
    while engine.has_unfinished():
        out = engine.step()
        max_running = max(max_running, len(engine.scheduler.running) + len(out))
        saw_waiting |= bool(engine.scheduler.waiting)
        done.update({o.request_id: o for o in out})
    assert max_running == 2 and saw_waiting
    for rid, ref in zip(ids, refs, strict=True):
        _assert_matches(done[rid], ref)
    _assert_all_free(engine)


def test_request_over_the_budget_gets_an_error_while_the_others_finish(setup):
    model, prompts, refs = setup
    engine = _engine(model, 16, max_kv_tokens=64)
    too_long = SamplingParams(max_new_tokens=50, stop_token_ids=())  # 1 + 4 pages > 4 pages in total
    params = [GREEDY, too_long, GREEDY]
    outputs = engine.generate([prompts[0], prompts[1], prompts[2]], params)
    assert outputs[1].finish_reason == "error" and outputs[1].token_ids == []
    assert "max_kv_tokens=64" in outputs[1].error and "max_new_tokens 50" in outputs[1].error
    _assert_matches(outputs[0], refs[0])
    _assert_matches(outputs[2], refs[2])
    _assert_all_free(engine)
    with pytest.raises(ValidationError, match="KV budget"):
        engine.add_request(prompts[1], too_long)
    with pytest.raises(ValidationError, match="max_context_len=64"):
        _engine(model, 16, max_kv_tokens=512).add_request(list(range(3, 60)), GREEDY)


def test_abort_frees_slots(setup):
    model, prompts, refs = setup
    engine = _engine(model, 16, max_kv_tokens=128)  # 8 pages: 4 requests run, the others wait
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()
    engine.step()
    free_before = engine.num_free_pages()
    aborted = engine.abort(ids[1])
    assert aborted.finish_reason == "abort" and aborted.token_ids == refs[1][0][:2]
    assert engine.num_free_pages() == free_before + 2
    waiting = engine.abort(ids[5])  # still queued: nothing allocated yet
    assert waiting.finish_reason == "abort" and waiting.token_ids == []
    assert engine.abort(ids[1]) is None and engine.abort("no-such-request") is None
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step()})
    assert set(done) == {ids[0], ids[2], ids[3], ids[4]}
    for i in (0, 2, 3, 4):
        _assert_matches(done[ids[i]], refs[i])
    _assert_all_free(engine)


def test_stop_token_ends_a_request(setup):
    model, prompts, refs = setup
    tokens = refs[3][0]
    stop = tokens[4]
    first = tokens.index(stop)
    engine = _engine(model, 16)
    out = engine.generate([prompts[3]], SamplingParams(max_new_tokens=STEPS, stop_token_ids=(stop,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == tokens[: first + 1]
    _assert_all_free(engine)


def test_seeded_sampling_is_per_request(setup):
    """A seeded request samples the same tokens alone or in a batch with others; top_k=1 is greedy."""
    model, prompts, refs = setup
    engine = _engine(model, 16)
    sampled = SamplingParams(
        max_new_tokens=STEPS, temperature=1.5, top_p=0.9, top_k=20, seed=11, stop_token_ids=()
    )
    alone = engine.generate([prompts[2]], sampled)[0].token_ids
    others = [
        SamplingParams(max_new_tokens=STEPS, temperature=1.0, seed=s, stop_token_ids=()) for s in (1, 2)
    ]
    batch = engine.generate([prompts[0], prompts[2], prompts[4]], [others[0], sampled, others[1]])
    assert batch[1].token_ids == alone
    reseeded = engine.generate([prompts[2]], SamplingParams(**{**sampled.__dict__, "seed": 12}))[0].token_ids
    assert reseeded != alone
    top1 = SamplingParams(max_new_tokens=STEPS, temperature=1.0, top_k=1, seed=3, stop_token_ids=())
    assert engine.generate([prompts[2]], top1)[0].token_ids == refs[2][0]
    _assert_all_free(engine)


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    kept = torch.isfinite(filter_logits(logits, 1.0, 0, 0.7)).tolist()
    assert kept == [True, True, False, False, False]  # 0.5 < 0.7, 0.5 + 0.2 >= 0.7: stop after two
    kept = torch.isfinite(filter_logits(logits, 1.0, 3, 1.0)).tolist()
    assert kept == [True, True, True, False, False]
    assert torch.isfinite(filter_logits(logits, 1.0, 0, 0.01)).sum() == 1  # always keeps the best token


def test_invalid_parameters_are_rejected(setup):
    model, _, _ = setup
    with pytest.raises(ValidationError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValidationError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValidationError, match="multiple of page_size"):
        EngineConfig(max_kv_tokens=100, page_size=16)
    with pytest.raises(ValidationError, match="outside the vocabulary"):
        _engine(model, 16).add_request([5, 999])
    with pytest.raises(ValidationError, match="needs a tokenizer"):
        _engine(model, 16).add_request("text without a tokenizer")
