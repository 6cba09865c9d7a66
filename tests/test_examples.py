"""The examples people run first (configs/*.yaml, README's commands) ask the embedded default model
for what it was trained on: its prompt grammar, 48x48, 9 frames, its default steps. Examples for real
checkpoints say so in a comment above the command."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from mmgen.default_model import DEFAULTS
from mmgen.render.schema import load_render_file
from mmgen.tiny.world import caption, parse_caption

ROOT = Path(__file__).resolve().parents[1]
SIZE_FLAGS = ("--height", "--width", "--frames", "--steps")


def in_grammar(prompt: str) -> bool:
    """'a <colour> <shape> moves <direction> on a <background> background' (or '... stays still ...')."""
    found = parse_caption(prompt)
    return None not in found.values() and caption(**found) == prompt


def check_default_model_jobs(plan, where: str) -> None:
    assert plan.model == "default", where
    for job in plan.jobs:
        kwargs = job.fields()
        assert in_grammar(job.prompt), f"{where} job {job.label}: {job.prompt!r}"
        trained = (DEFAULTS.height, DEFAULTS.width, DEFAULTS.num_frames)
        asked = tuple(
            kwargs.get(k, d) for k, d in zip(("height", "width", "num_frames"), trained, strict=True)
        )
        assert asked == trained, f"{where} job {job.label}: {asked}"
        assert kwargs.get("num_inference_steps", DEFAULTS.num_inference_steps) == DEFAULTS.num_inference_steps


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_config_examples_ask_the_default_model_for_what_it_was_trained_on(name):
    check_default_model_jobs(load_render_file(ROOT / "configs" / name), name)


def readme_blocks(*kinds: str) -> list[list[str]]:
    """The lines of README's fenced blocks whose language is one of `kinds` ("" = none given),
    backslash continuations joined."""
    blocks, current, kind = [], None, ""
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```") and current is None:
            current, kind = [], line[3:].strip()
        elif line.startswith("```"):
            if kind in kinds:
                blocks.append("\n".join(current).replace("\\\n", " ").splitlines())
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_readme_commands_use_the_default_models_grammar_or_name_their_checkpoint():
    commands = 0
    for lines in readme_blocks("bash", ""):
        for i, line in enumerate(lines):
            words = shlex.split(line, comments=True)
            if "generate" not in words or not ({"mmgen", "mmgen.cli"} & set(words)):
                continue
            prompt = words[words.index("generate") + 1]
            if prompt == "a prompt":
                continue  # the CLI synopsis, not an example
            commands += 1
            if "--model" in words:
                above = lines[i - 1] if i else ""
                assert above.startswith("# a real checkpoint:"), line
                continue
            assert in_grammar(prompt), line
            assert not set(SIZE_FLAGS) & set(words), line
    assert commands >= 8
    # the batch-render snippet
    (snippet,) = readme_blocks("yaml")
    config = yaml.safe_load("\n".join(snippet))
    assert config["defaults"]["height"] == DEFAULTS.height and "num_inference_steps" not in config["defaults"]
    assert all(in_grammar(job["prompt"]) for job in config["jobs"])
