"""Execution settings travel as a value (mmgen.models.settings.ExecutionSettings), never as module state.

1. A static scan (ast, every *.py under mmgen/ and pipelines/): no attribute is assigned on any
   object but `self` (`x.attr = ...`, `x.a.b = ...`, augmented or annotated), no `setattr(` outside
   mmgen/lora/apply.py's module swapping, and `object.__setattr__` only inside a dataclass's
   `__post_init__`. The exceptions are listed below, each with its reason; none is a per-call
   setting. The scan is shown to catch planted assignments.
2. Two calls with different settings on one pipeline, interleaved, each give the output of the
   same call run alone on a fresh pipeline (SHA-equal): one call made inside another's denoise loop
   (between its steps), and calls alternating with offload, LoRA, FP8 and chunks on and off.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

from mmgen.models.settings import ExecutionSettings
from mmgen.progress import NullProgress
from pipelines.wan_t2v import WanT2VPipeline

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("mmgen", "pipelines")
# Attributes whose assignment rebinds a tensor's or array's own storage or flags: not a setting.
STORAGE_ATTRIBUTES = frozenset({"data", "writeable"})
# (file, assigned target) -> why it is not a per-call setting written onto a module.
ALLOWED = {
    ("mmgen/llm/model_runner.py", "batch.extend_seq_lens"): "the LLM engine fills its per-step batch record",
    (
        "mmgen/llm/model_runner.py",
        "batch.extend_seq_lens_cpu",
    ): "the LLM engine fills its per-step batch record",
    (
        "mmgen/llm/model_runner.py",
        "batch.extend_prefix_lens",
    ): "the LLM engine fills its per-step batch record",
    (
        "mmgen/llm/model_runner.py",
        "batch.extend_prefix_lens_cpu",
    ): "the LLM engine fills its per-step batch record",
    ("mmgen/llm/scheduler.py", "req.allocation"): "the scheduler's request record (not a module)",
    ("mmgen/llm/scheduler.py", "req.finish_reason"): "the scheduler's request record (not a module)",
    ("mmgen/cli_args.py", "handling.previous"): "the SIGTERM context's own record (not a module)",
    ("mmgen/loading/tokenizer.py", "tokenizer.pre_tokenizer"): "building a tokenizer object at load time",
    ("mmgen/loading/tokenizer.py", "tokenizer.decoder"): "building a tokenizer object at load time",
    ("mmgen/loading/tokenizer.py", "tokenizer.post_processor"): "building a tokenizer object at load time",
    ("mmgen/loading/umt5.py", "wo.weight"): "loading: ties a checkpoint weight once",
    (
        "mmgen/lora/pack.py",
        "holder.concat_weight",
    ): "applying a LoRA (model setup per LoRA set, not per call)",
    ("mmgen/lora/pack.py", "holder.concat_down"): "applying a LoRA (model setup per LoRA set, not per call)",
    (
        "mmgen/lora/pack.py",
        "holder.concat_members",
    ): "applying a LoRA (model setup per LoRA set, not per call)",
    ("mmgen/layers/low_rank.py", "layer.kernel"): "set_low_rank_kernel: explicit setup for A/B timing",
    ("mmgen/placement/tensors.py", "self._unregister.atexit"): "a weakref.finalize flag of the store",
    (
        "pipelines/tiny_world/train.py",
        "torch.backends.cudnn.deterministic",
    ): "the trainer's process-wide determinism",
    (
        "pipelines/tiny_world/train.py",
        "torch.backends.cudnn.benchmark",
    ): "the trainer's process-wide determinism",
    (
        "pipelines/tiny_world/train.py",
        "torch.backends.cuda.matmul.allow_tf32",
    ): "the trainer's process-wide determinism",
}
SETATTR_FILES = frozenset({"mmgen/lora/apply.py"})  # swaps a Linear for a LowRankLinear and back


def attribute_writes(source: str, path: str) -> list[str]:
    """Every assignment of an attribute on something other than `self`, and every setattr outside the
    allowed places, as 'path:line: text'."""
    found = []
    tree = ast.parse(source, filename=path)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for part in ast.walk(target):
                if not isinstance(part, ast.Attribute) or not isinstance(part.ctx, ast.Store):
                    continue
                text = ast.unparse(part)
                on_self = isinstance(part.value, ast.Name) and part.value.id in ("self", "cls")
                if on_self or part.attr in STORAGE_ATTRIBUTES or (path, text) in ALLOWED:
                    continue
                found.append(f"{path}:{part.lineno}: {text} = ...")
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name == "setattr" and path not in SETATTR_FILES:
                found.append(f"{path}:{node.lineno}: setattr(...)")
            if name == "object.__setattr__" and _enclosing_function(node, parents) != "__post_init__":
                found.append(f"{path}:{node.lineno}: object.__setattr__ outside __post_init__")
    return found


def _enclosing_function(node: ast.AST, parents: dict) -> str | None:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return node.name
    return None


def test_no_attribute_is_written_onto_another_object():
    found = []
    for room in SCANNED:
        for path in sorted((ROOT / room).rglob("*.py")):
            found += attribute_writes(path.read_text(), str(path.relative_to(ROOT)))
    assert found == [], "attributes written onto other objects (pass a value instead):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "planted",
    [
        "def arrange(expert, plan):\n    for block in expert.blocks:\n        block.block_chunk = plan.block_chunk\n",
        "def arrange(expert, stream):\n    expert.block_stream = stream\n",
        "def arrange(self, chunk):\n    self.ffn.token_chunk = chunk\n",
        "def arrange(modules):\n    for m in modules:\n        m.count += 1\n",
        "def arrange(module, kinds):\n    setattr(module, 'fp8_layers', kinds)\n",
        "def arrange(module):\n    object.__setattr__(module, 'fp8_attention', True)\n",
    ],
)
def test_the_scan_catches_a_planted_assignment(planted):
    assert len(attribute_writes(planted, "pipelines/planted.py")) == 1


def test_the_scan_lets_self_storage_and_post_init_pass():
    allowed = (
        "class A:\n    def __init__(self):\n        self.x = 1\n"
        "    def __post_init__(self):\n        object.__setattr__(self, 'y', 2)\n"
        "def bind(tensor, other):\n    tensor.data = other\n"
    )
    assert attribute_writes(allowed, "mmgen/ok.py") == []


def test_settings_are_checked_and_frozen():
    settings = ExecutionSettings(block_chunk=8, fp8_layers={"self_qkv"})
    assert settings.fp8_layers == frozenset({"self_qkv"})
    with pytest.raises(AttributeError):
        settings.block_chunk = 4  # frozen
    for bad in ({"block_chunk": 0}, {"ffn_chunk": True}, {"fp8_layers": {"to_q"}}, {"fp8_attention": 1}):
        with pytest.raises(Exception, match="block_chunk|ffn_chunk|allowed values|fp8_attention"):
            ExecutionSettings(**bad)


# ---- through the pipeline (the embedded tiny default model) ----

CALL = dict(height=32, width=48, num_frames=5, num_inference_steps=3, seed=7)
SETTINGS = {
    "plain": {},
    "chunks": dict(block_chunk=7, ffn_chunk=5),
    "fp8": dict(fp8_linear=True, fp8_attention=True),
    "fp8_chunks": dict(fp8_linear=True, fp8_attention=True, block_chunk=7),
    "layer": dict(offload="layer"),
    "cfg_sequential": dict(cfg="sequential"),
}


@pytest.fixture(scope="module")
def lora_file(default_model_dir, tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tests"))
    from lora_cases import save, wan_lora

    model = WanT2VPipeline.from_pretrained(default_model_dir).transformer
    return str(
        save(tmp_path_factory.mktemp("lora") / "l.safetensors", *wan_lora(model, seed=3, extras=False))
    )


@pytest.fixture(scope="module")
def alone(default_model_dir, lora_file):
    """Each setting's (frames, latents) sha256, run as the first call of a fresh pipeline."""
    shas = {}
    for name, extra in {**SETTINGS, "lora": dict(lora=lora_file)}.items():
        result = WanT2VPipeline.from_pretrained(default_model_dir)(
            "a red ball", progress=False, **CALL, **extra
        )
        shas[name] = (result.frames_sha256, result.latents_sha256)
    return shas


class CallBetweenSteps(NullProgress):
    """A reporter that runs another call on the same pipeline after the outer call's first denoise step."""

    def __init__(self, pipe: WanT2VPipeline, extra: dict) -> None:
        self.pipe, self.extra, self.inner, self._stage = pipe, extra, None, None

    def stage(self, name: str, total: int) -> None:
        self._stage = name

    def advance(self, units: int = 1) -> None:
        if self._stage == "denoise" and self.inner is None:
            self.inner = self.pipe("a red ball", progress=False, **CALL, **self.extra)


@pytest.mark.parametrize(
    ("outer", "inner"),
    [("plain", "fp8_chunks"), ("fp8", "plain"), ("chunks", "fp8"), ("fp8_chunks", "chunks")],
)
def test_a_call_inside_another_calls_loop_keeps_both_outputs(default_model_dir, alone, outer, inner):
    pipe = WanT2VPipeline.from_pretrained(default_model_dir)
    reporter = CallBetweenSteps(pipe, SETTINGS[inner])
    result = pipe("a red ball", progress=reporter, **CALL, **SETTINGS[outer])
    assert (result.frames_sha256, result.latents_sha256) == alone[outer]
    assert (reporter.inner.frames_sha256, reporter.inner.latents_sha256) == alone[inner]


def test_alternating_calls_each_equal_the_call_alone(default_model_dir, alone, lora_file):
    pipe = WanT2VPipeline.from_pretrained(default_model_dir)
    order = [
        "fp8",
        "plain",
        "layer",
        "fp8_chunks",
        "lora",
        "chunks",
        "plain",
        "cfg_sequential",
        "fp8",
        "lora",
    ]
    for name in order:
        extra = dict(lora=lora_file) if name == "lora" else SETTINGS[name]
        result = pipe("a red ball", progress=False, **CALL, **extra)
        assert (result.frames_sha256, result.latents_sha256) == alone[name], name


def test_fp8_weight_copies_are_reused_across_calls_and_left_by_calls_without_fp8(default_model_dir):
    pipe = WanT2VPipeline.from_pretrained(default_model_dir)
    cache = pipe.transformer.blocks[0].attn1.fp8_weights
    pipe("a red ball", progress=False, fp8_linear=True, **CALL)
    first = dict(cache._entries)
    assert first
    pipe("a red ball", progress=False, **CALL)  # no FP8: the copies stay
    assert dict(cache._entries) == first
    pipe("a red ball", progress=False, fp8_linear=True, **CALL)  # reused, not re-made
    assert all(cache._entries[name][1] is entry[1] for name, entry in first.items())
    pipe("a red ball", progress=False, gpu_memory_gb=64, **CALL)  # a budget without FP8 drops them
    assert len(cache) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_settings_leave_no_state_and_stream_through_the_value():
    """bf16 on a GPU: an FP8 call, a chunked call and a plain call interleave on one model without
    touching each other (plain after FP8 is bitwise the plain output, FP8 twice is bitwise equal and
    reuses the weight copies), and layer offload streams through ExecutionSettings.block_stream."""
    import copy

    from mmgen.attention import select_attention
    from mmgen.models.wan import WanConfig, WanDiT
    from mmgen.placement.offload import OffloadPlacement

    device = torch.device("cuda")
    torch.manual_seed(0)
    config = WanConfig(
        num_attention_heads=4, attention_head_dim=64, text_dim=256, ffn_dim=1024, num_layers=4, text_len=64
    )
    model = WanDiT(config).to(device, torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 3, 16, 16, generator=g).to(device)
    t = torch.tensor([700.0, 700.0], device=device)
    text = torch.randn(2, 64, 256, generator=g).to(device, torch.bfloat16)
    attention = select_attention("sdpa", device=device, dtype=torch.bfloat16, head_dim=64)

    def call(m, settings=None):
        with torch.no_grad():
            return m(x, t, text, attention=attention, settings=settings)

    plain = call(model)
    fp8 = ExecutionSettings(fp8_layers=frozenset({"self_qkv", "cross_q", "attn_out", "ffn_in", "ffn_out"}))
    first = call(model, fp8)
    copies = dict(model.blocks[0].attn1.fp8_weights._entries)
    chunked = call(model, ExecutionSettings(block_chunk=100, ffn_chunk=100))
    assert torch.equal(call(model, fp8), first) and torch.equal(call(model), plain)
    assert all(model.blocks[0].attn1.fp8_weights._entries[k][1] is v[1] for k, v in copies.items())
    assert 1e-4 < float((first.float() - plain.float()).norm() / plain.float().norm()) < 0.05
    streamed = copy.deepcopy(model).cpu()
    side = {"text_encoder": torch.nn.Linear(2, 2), "vae": torch.nn.Linear(2, 2)}
    placement = OffloadPlacement("layer", experts=[streamed], device=device, **side)
    assert torch.equal(call(streamed, ExecutionSettings(block_stream=placement.stream)), plain)
    in_chunks = ExecutionSettings(block_stream=placement.stream, block_chunk=100, ffn_chunk=100)
    assert torch.equal(call(streamed, in_chunks), chunked)
    placement.park_all()
