"""Generation on several ranks: WanT2VPipeline(parallel=layout) and `mmgen generate --gpus N` on forked
gloo worlds against one process, and the launch errors that must come before any model loads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import parallel_workers
import pytest
import torch

from mmgen.cli import GenerateRun, build_parser, generate_on_rank, generate_request, main, parallel_config
from mmgen.errors import ValidationError
from mmgen.parallel.launch import check_devices
from mmgen.parallel.layout import ParallelConfig


@pytest.mark.parametrize(
    "config", [ParallelConfig(sp=2), ParallelConfig(cfg=True), ParallelConfig(sp=2, ring=2)], ids=str
)
def test_pipeline_on_a_gloo_world_matches_one_process(config, default_model_dir):
    single = parallel_workers.generate_latents(None, default_model_dir)
    latents = parallel_workers.run_forked(parallel_workers.generate_latents, config, default_model_dir)
    # Two guided steps: each rank's rounding differs from one process's by GEMM shape at most (a sequence
    # shard, a ring's blockwise softmax, one CFG branch instead of a batch of 2). Through the trained
    # default model that reaches ~2e-5 on CPU (latents up to ~3), as batched vs sequential CFG does in
    # test_denoise_loop, hence the same 1e-4, far below what a wrong shard or exchange would change.
    torch.testing.assert_close(latents, single, atol=1e-4, rtol=1e-4)


def test_split_decode_in_a_gloo_world_matches_one_process(default_model_dir):
    import numpy as np

    single = parallel_workers.generate_frames(None, default_model_dir, "full")
    alone = parallel_workers.generate_frames(None, default_model_dir, "split")
    np.testing.assert_array_equal(alone, single)  # one rank: diffusers' decode loop, same shapes
    # Ulysses 2 denoises; each of the 2 ranks decodes half the width. Latents within GEMM rounding
    # (test above) and bands within conv rounding: at most a level on a few boundary values.
    frames = parallel_workers.run_forked(
        parallel_workers.generate_frames, ParallelConfig(sp=2), default_model_dir, "split"
    )
    assert frames.shape == single.shape and frames.dtype == np.uint8
    diff = np.abs(frames.astype(np.int16) - single.astype(np.int16))
    assert diff.max() <= 2 and (diff > 0).mean() < 1e-2


@pytest.mark.parametrize(("ranks", "bands"), [(2, 4), (4, 8), (4, 2)], ids=str)
def test_bands_decode_spread_over_ranks_has_one_process_bits(ranks, bands):
    """bands2/4/8 over several ranks: each rank decodes a run of the same bands one process decodes
    one after another (the same plan, the same per-band work), so the frames are that process's bit for
    bit, on any number of ranks (4 ranks, 2 bands: every rank decodes both). `split` (a band per rank)
    has other bands on other rank counts: equal in values only."""
    import numpy as np

    spread, alone = parallel_workers.run_forked(
        parallel_workers.spread_bands_frames, ParallelConfig(sp=ranks), bands
    )
    assert spread.shape == alone.shape and spread.dtype == np.float32
    np.testing.assert_array_equal(spread, alone)


def test_default_decode_on_several_ranks_is_one_process_bit_for_bit(default_model_dir):
    """The default decode on several ranks is the one that is exact in bits: every rank decodes the
    whole frames (split, a band per rank, is exact in values only: the test above). Under CFG 2 alone
    the denoise runs one process's sequential-CFG calls, so the frames are its frames, on every rank."""
    import numpy as np

    single, _ = parallel_workers.default_decode_frames(None, default_model_dir, "sequential")
    frames, same = parallel_workers.run_forked(
        parallel_workers.default_decode_frames, ParallelConfig(cfg=True), default_model_dir, None
    )
    assert same == 2  # both ranks hold rank 0's frames
    np.testing.assert_array_equal(frames, single)


def test_generate_gpus_2_writes_once_from_rank_0(mmgen_cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
    out = tmp_path / "two.mp4"
    args = build_parser().parse_args(
        [
            "generate",
            "a red fox",
            "--frames",
            "5",
            "--steps",
            "2",
            "--no-progress",
            "--gpus",
            "2",
            "--out",
            str(out),
        ]
    )
    run = GenerateRun(generate_request(args), out, False, "cpu", "auto")
    lines = parallel_workers.run_forked(generate_on_rank, parallel_config(args), args, run)
    fields = dict(line.split(": ", 1) for line in lines)
    assert fields["output"] == str(out) and out.stat().st_size > 0
    assert fields["parallel"] == "sp2(ulysses2 x ring1) x cfg1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two.mp4"]  # rank 1 wrote nothing


def test_gpus_beyond_the_visible_gpus_is_an_error_before_loading(capsys):
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2 GPUs")
    with pytest.raises(
        ValidationError, match=r"--gpus 2 asks for more GPUs than this machine shows \(. visible"
    ):
        check_devices(ParallelConfig(sp=2), "cuda")
    # the flag arithmetic is checked before anything imports a model
    assert main(["generate", "x", "--gpus", "3", "--sp", "2"]) == 2
    assert "--gpus 3 does not match --sp 2 = 2 processes" in capsys.readouterr().err


def test_a_parallel_config_in_one_plain_process_says_how_to_start_workers(monkeypatch):
    from mmgen.parallel.launch import resolve_layout

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resolve_layout(None, "cpu").is_single and resolve_layout(ParallelConfig(), "cpu").is_single
    with pytest.raises(
        ValidationError, match="2 processes in a single process: start the workers .* torchrun"
    ):
        resolve_layout(ParallelConfig(sp=2), "cpu")


def test_heads_that_do_not_split_over_ulysses_fail_before_any_rank_spawns(
    tmp_path, monkeypatch, capsys, mmgen_cache_dir
):
    # Seen: a 3-head model with --sp 2 loaded on both ranks, then failed. The launcher reads the
    # transformer's config.json first; nothing spawns (run_parallel) and no weights are read.
    import json

    from mmgen.loading.wan_transformer import wan_heads
    from mmgen.parallel import launch

    def no_spawn(*args, **kwargs):
        raise AssertionError("run_parallel was called: the head check came after the workers started")

    monkeypatch.setattr(launch, "run_parallel", no_spawn)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = tmp_path / "three-heads"
    (model / "transformer").mkdir(parents=True)
    (model / "transformer" / "config.json").write_text(json.dumps({"num_attention_heads": 3}))
    (model / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))  # the Wan family's
    assert (
        main(["generate", "x", "--model", str(model), "--gpus", "2", "--out", str(tmp_path / "o.mp4")]) == 2
    )
    err = capsys.readouterr().err
    assert "3 attention heads do not split over Ulysses degree 2" in err and "--ring" in err
    # the original Wan2.2 A14B layout names the field num_heads; the default model (4 heads) with --sp 3
    original = tmp_path / "a14b"
    (original / "high_noise_model").mkdir(parents=True)
    (original / "high_noise_model" / "config.json").write_text(json.dumps({"num_heads": 40}))
    assert wan_heads(original) == 40 and wan_heads(tmp_path) is None
    (original / "transformer").mkdir()  # an original-layout Wan2.1 transformer folder
    (original / "transformer" / "config.json").write_text(json.dumps({"num_heads": 12}))
    assert wan_heads(original) == 12
    wan21 = tmp_path / "wan21"  # the original Wan2.1 (T2V, VACE) layout: the DiT's config at the root
    wan21.mkdir()
    (wan21 / "config.json").write_text(json.dumps({"num_heads": 12, "model_type": "vace"}))
    assert wan_heads(wan21) == 12
    monkeypatch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
    assert main(["generate", "x", "--gpus", "3", "--out", str(tmp_path / "o.mp4")]) == 2
    assert "4 attention heads do not split over Ulysses degree 3" in capsys.readouterr().err
    # a ring takes any head count: the check passes and the launch goes on
    launch.check_model_heads(ParallelConfig(sp=2, ring=2), 3)


def rank_processes() -> list[str]:
    """The names of this process's live children that are started ranks (mmgen.parallel.standby)."""
    import multiprocessing

    return sorted(p.name for p in multiprocessing.active_children() if p.name.startswith("mmgen-rank"))


def test_generate_gpus_starts_its_ranks_before_it_parses(mmgen_cache_dir, tmp_path, monkeypatch, capsys):
    """`generate --gpus 2` spawns its 2 ranks before its own parse, which imports torch and the request
    (seconds on a GPU host): the ranks' imports overlap it. The run is handed to those processes,
    and they are stopped when the command ends."""
    from mmgen import cli
    from mmgen.parallel import launch

    seen = {}
    request_flags = cli.add_request_flags

    def flags_at_parse(parser):
        seen["at parse"] = rank_processes()
        return request_flags(parser)

    def handed(fn, config, *args, started=None, **kwargs):
        seen["handed"] = sorted(p.name for p in started.processes if p.is_alive())
        seen["world"] = (started.world.gpus, started.world.sp, started.world.ring, started.world.cfg)
        return ["output: handed"]

    monkeypatch.setattr(cli, "add_request_flags", flags_at_parse)
    monkeypatch.setattr(launch, "run_parallel", handed)
    monkeypatch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = ["generate", "x", "--device", "cpu", "--out", str(tmp_path / "o.mp4")]
    assert main([*argv, "--gpus", "2"]) == 0
    assert capsys.readouterr().out == "output: handed\n"
    ranks = ["mmgen-rank0", "mmgen-rank1"]
    assert seen == {"at parse": ranks, "handed": ranks, "world": (2, None, 1, False)}
    assert rank_processes() == []  # stopped when the command ended
    # the world they join early is the one the flags ask for
    assert main([*argv, "--gpus=2", "--cfg-parallel"]) == 0 and seen["world"] == (2, None, 1, True)
    assert main([*argv, "--gpus", "4", "--sp", "4", "--ring", "2"]) == 0 and seen["world"] == (4, 4, 2, False)
    # one process: nothing starts early
    seen.clear()
    monkeypatch.setattr(launch, "run_parallel", lambda *a, **k: pytest.fail("one process spawned ranks"))
    monkeypatch.setattr(cli, "generate_on_rank", lambda layout, args, run: ["output: here"])
    assert main([*argv, "--gpus=1"]) == 0 and seen == {"at parse": []}


def test_a_refused_request_stops_the_ranks_started_for_it(mmgen_cache_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = ["generate", "x", "--gpus", "2", "--device", "cpu", "--steps", "1000000000"]
    assert main([*argv, "--out", str(tmp_path / "o.mp4")]) == 2
    assert "--steps" in capsys.readouterr().err
    assert rank_processes() == [] and not (tmp_path / "o.mp4").exists()


def test_the_generate_command_on_two_ranks_ends_clean_and_says_where_its_start_went(
    mmgen_cache_dir, tmp_path
):
    """The console command (early-started ranks, its os._exit) on 2 gloo ranks: exit 0, the file once,
    the seconds line leading with rank 0's start, load and world wait, and no resource-tracker warning of leaked
    semaphores (the started ranks' queue was never freed before the exit)."""
    out = tmp_path / "two.mp4"
    command = [sys.executable, "-m", "mmgen.cli", "generate", "a red fox", "--frames", "5", "--steps", "1"]
    command += ["--gpus", "2", "--device", "cpu", "--no-progress", "--out", str(out)]
    env = {**os.environ, "MMGEN_CACHE_DIR": str(mmgen_cache_dir), "PYTHONWARNINGS": "default"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two.mp4"]
    seconds = next(line for line in done.stdout.splitlines() if line.startswith("seconds: "))
    names = [item.rsplit(" ", 1)[0] for item in seconds.removeprefix("seconds: ").split(", ")]
    # world_wait: the part of rank 0's load spent waiting for its early-started world
    assert names[:4] == ["start", "load", "world_wait", "text_encode"] and names[-1] == "export"
    assert "leaked" not in done.stderr and "Warning" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("signum", "status", "line"),
    [(signal.SIGINT, 130, "mmgen: interrupted"), (signal.SIGTERM, 143, "mmgen: terminated")],
    ids=["ctrl-c", "sigterm"],
)
def test_a_signal_to_two_ranks_group_is_the_commands_interrupt(
    mmgen_cache_dir, tmp_path, signum, status, line
):
    """Ctrl-C (or `timeout`'s SIGTERM) reaches the whole process group (the command, which is rank 0, and
    rank 1): the command says "interrupted" / "terminated" once and exits 130 / 143, as on one GPU, and
    publishes nothing; its stderr (which its ranks and multiprocessing's resource tracker share until they
    end) holds that line alone: no rank's failure (a rank interrupted or ended by the signal is the command's
    interrupt), no leaked semaphore."""
    out = tmp_path / "two.mp4"
    command = [sys.executable, "-m", "mmgen.cli", "generate", "a red fox", "--frames", "5", "--steps", "1000"]
    command += ["--gpus", "2", "--device", "cpu", "--no-progress", "--out", str(out)]
    env = {**os.environ, "MMGEN_CACHE_DIR": str(mmgen_cache_dir), "PYTHONWARNINGS": "default"}
    running = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    time.sleep(8)  # started (~3 s on 2 cores) and denoising: 1000 steps take far longer
    assert running.poll() is None, running.communicate()
    os.killpg(running.pid, signum)
    _, err = running.communicate(timeout=60)
    assert (running.returncode, err.strip()) == (status, line)
    assert list(tmp_path.iterdir()) == []
