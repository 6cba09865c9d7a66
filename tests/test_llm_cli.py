"""`mmgen enhance` and PromptEnhancer on a tiny saved T5Gemma with a word tokenizer."""

from __future__ import annotations

import pytest
from test_llm_tiny_model import build_tiny_t5gemma

from mmgen.errors import MmgenError
from mmgen.llm.cli import main
from mmgen.llm.engine import Engine, EngineConfig
from mmgen.llm.enhancer import RAW_TEMPLATE, PromptEnhancer
from mmgen.llm.sampling import SamplingParams
from mmgen.loading.tokenizer import build_word_tokenizer

WORDS = (
    "a cat dog runs on the beach at sunset slow camera pan golden light waves red car city night rain".split()
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("t5gemma_cli")
    build_tiny_t5gemma(directory, seed=2)
    build_word_tokenizer(WORDS, directory)
    return directory


def test_enhance_prints_text(model_dir, capsys):
    code = main(["enhance", "a cat on the beach", "--model", str(model_dir), "--max-new-tokens", "12"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.out.strip() and out.err == ""


def test_enhance_missing_model_dir_is_one_line_error(tmp_path, capsys):
    code = main(["enhance", "a cat", "--model", str(tmp_path / "missing")])
    out = capsys.readouterr()
    assert code != 0 and out.out == ""
    assert out.err.count("\n") == 1 and "missing" in out.err and out.err.startswith("error: ")


def test_prompt_enhancer_is_a_str_callable_matching_the_engine(model_dir):
    """The enhancer's text is the engine's greedy output for the templated prompt, decoded."""
    params = SamplingParams(max_new_tokens=10, stop_token_ids=())
    enhancer = PromptEnhancer.from_pretrained(model_dir, template="describe: {prompt}", params=params)
    text = enhancer("red car at night")
    engine = Engine.from_pretrained(model_dir, EngineConfig(max_kv_tokens=256, page_size=1))
    out = engine.generate(["describe: red car at night"], params)[0]
    assert isinstance(text, str) and text == out.text.strip() and len(out.token_ids) == 10
    assert enhancer.enhance_batch(["red car at night", "a dog"])[0] == text


def test_prompt_enhancer_refuses_an_empty_result(model_dir):
    """A model that stops at once yields no text: a clear error, not an empty prompt for the pipeline."""
    engine = Engine.from_pretrained(model_dir, EngineConfig(max_kv_tokens=256))
    first = engine.generate(["a cat"], SamplingParams(max_new_tokens=1, stop_token_ids=()))[0].token_ids[0]
    stop_at_once = SamplingParams(max_new_tokens=4, stop_token_ids=(first,))
    with pytest.raises(MmgenError, match="produced no text"):
        PromptEnhancer(engine, template=RAW_TEMPLATE, params=stop_at_once)("a cat")
