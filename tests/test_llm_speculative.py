"""Speculative decoding: greedy output equals the engine's plain greedy output token for token.

Drafts: a smaller random encoder-decoder (almost nothing accepted), the target with 10% weight noise
(about half accepted: both draft catch-up lengths occur), and the target itself (everything accepted).
"""

from __future__ import annotations

import copy

import pytest
import torch
from llm_backend_cases import random_prompts, tiny_t5gemma

from mmgen.llm.engine import Engine, EngineConfig
from mmgen.llm.forward_batch import ForwardMode
from mmgen.llm.sampling import SamplingParams
from mmgen.llm.speculative import ModelSession, SpeculativeDecoder

PROMPT_LENS = (3, 13, 5, 9, 7, 11)  # every request its own encoder length
STEPS = 12  # longer than the window (4): sliding layers trim


@pytest.fixture(scope="module")
def target():
    return tiny_t5gemma(seed=1)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, PROMPT_LENS)


@pytest.fixture(scope="module")
def greedy(target, prompts):
    engine = Engine(target, EngineConfig(max_kv_tokens=1024, page_size=16, max_context_len=64))
    return [
        o.token_ids for o in engine.generate(prompts, SamplingParams(max_new_tokens=STEPS, stop_token_ids=()))
    ]


def _noisy(model, scale: float, seed: int):
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.mul_(1 + scale * torch.randn(param.shape, generator=gen))
    return draft


def _sessions(target, draft, backend: str, page_size: int = 16):
    kw = dict(backend=backend, page_size=page_size, max_context=64, max_kv_tokens=2048)
    return ModelSession(target, **kw), ModelSession(draft, **kw)


def _record_steps(session: ModelSession) -> list[tuple[ForwardMode, list[int], list[int]]]:
    """Wrap session.step to log (mode, prefix_lens, tokens per request) of every call."""
    log, step = [], session.step

    def recording(mode, allocs, prefix_lens, tokens, draft_token_num=None):
        log.append((mode, list(prefix_lens), [len(t) for t in tokens]))
        return step(mode, allocs, prefix_lens, tokens, draft_token_num)

    session.step = recording
    return log


@pytest.mark.parametrize(
    "backend,k,page_size",
    [("torch_native", 3, 16), ("flash_attention", 4, 1), ("flashinfer", 3, 16)],
)
def test_noisy_draft_equals_greedy(target, prompts, greedy, backend, k, page_size):
    ts, ds = _sessions(target, _noisy(target, 0.1, seed=5), backend, page_size)
    draft_log = _record_steps(ds)
    result = SpeculativeDecoder(ts, ds, num_draft_tokens=k).generate(prompts, STEPS)
    assert result.token_ids == greedy
    assert 0.2 < result.acceptance_rate < 0.95
    assert result.target_steps < STEPS  # fewer target forwards than tokens
    catch_up = [n for mode, _, counts in draft_log if mode is ForwardMode.DRAFT_EXTEND_V2 for n in counts]
    assert set(catch_up) == {1, 2}  # partial acceptance (bonus only) and full acceptance (dk + bonus)


def test_smaller_draft_equals_greedy(target, prompts, greedy):
    draft = tiny_t5gemma(seed=9, hidden=16, layers=2, heads=2, kv_heads=1)
    ts, ds = _sessions(target, draft, "torch_native")
    result = SpeculativeDecoder(ts, ds, num_draft_tokens=2).generate(prompts, STEPS)
    assert result.token_ids == greedy
    assert result.proposed > 0 and result.acceptance_rate < 0.5


def test_self_draft_accepts_everything(target, prompts, greedy):
    ts, ds = _sessions(target, target, "torch_native")
    result = SpeculativeDecoder(ts, ds, num_draft_tokens=3).generate(prompts, STEPS)
    assert result.token_ids == greedy
    assert result.acceptance_rate == 1.0
    # prefill gives 1 token, each verify 4 (3 accepted + bonus): 1 + 3 * 4 >= 12
    assert result.target_steps == 4


def test_stop_tokens_end_each_request(target, prompts, greedy):
    stop = greedy[2][2]  # a token request 2 emits mid-sequence
    engine = Engine(target, EngineConfig(max_kv_tokens=1024, page_size=16, max_context_len=64))
    params = SamplingParams(max_new_tokens=STEPS, stop_token_ids=(stop,))
    expected = [o.token_ids for o in engine.generate(prompts, params)]
    assert 1 < len(expected[2]) < STEPS and expected[2][-1] == stop
    ts, ds = _sessions(target, _noisy(target, 0.1, seed=5), "torch_native")
    result = SpeculativeDecoder(ts, ds, num_draft_tokens=3).generate(prompts, STEPS, stop_token_ids=(stop,))
    assert result.token_ids == expected
    assert ts.memory.page_allocator.num_free() == ts.memory.page_allocator.num_pages  # all released
