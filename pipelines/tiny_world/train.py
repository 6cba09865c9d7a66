"""Train the embedded default model on the tiny world: `python3 -m pipelines.tiny_world.train --out DIR`.

Three stages, one seed:
1. VAE: a tiny diffusers AutoencoderKLWan (4x spatial, 2x temporal: 9 frames of 48x48 -> 5 x 12 x 12
   latents of Z_DIM channels) trained on rendered clips with a reconstruction loss that weights the
   small foreground more than the background, plus a light KL term.
2. Latents: a bank of training clips encoded once (posterior mean); their per-channel mean and std
   become the VAE config's latents_mean / latents_std, which the pipeline uses to denormalize.
3. DiT + text encoder: a tiny WanDiT and a tiny UMT5 trained jointly with rectified flow, in the
   convention diffusers' flow schedulers (UniPC / FlowMatch Euler with flow_shift) sample with:
   sigma s, x_s = (1 - s) x0 + s eps, the model gets timestep 1000 s and predicts eps - x0. sigma is
   drawn uniformly and then shifted by FLOW_SHIFT, the same map the scheduler applies to its
   inference sigmas, so training sees the noise levels sampling visits. 10% of the captions are
   replaced by "" (the default negative prompt), so classifier-free guidance has an unconditional
   model to push away from. The text is zero-padded to the DiT's text_len (512) exactly as the
   pipeline pads it, and attended without a mask, as Wan does. The exported DiT and text encoder are
   an exponential moving average of the trained weights (EMA_DECAY), as diffusion trainers ship.

The stages can run as separate processes (`--stage vae --out A`, then `--stage dit --vae A --out B`),
so each fits one lent-GPU call; every stage draws from its own seeded generators, so the split run
writes the same bytes as `--stage all`.

Why the text encoder is trained jointly rather than frozen: frozen, a random 2-layer UMT5 maps each
word to an arbitrary vector, and the DiT would have to untangle words from their mixing with the
context on its own; the foreground colour word and the background colour word would then only be
told apart by position. Trained jointly (the same loss, gradients through cross-attention), the
encoder learns features that separate the attributes, and it costs nothing extra at this size.

Determinism: scenes come from numpy generators seeded from --seed; noise, sigmas and caption
dropout from a CPU torch generator; weights from torch.manual_seed; on CUDA deterministic algorithms
are requested (cuDNN deterministic, cuBLAS workspace config). Same seed + same device and software
-> the same weights. Writes DIR/model.json (configs, defaults, loss curve) and three safetensors.

This file runs the stages and writes the model; the clips, latent bank, text and noise levels are in
data.py, the two training loops in loops.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan
from safetensors.torch import load_file, save_file

from mmgen.default_model import MANIFEST, TRANSFORMER, VAE, WORDS, Z_DIM
from mmgen.loading.tokenizer import TextTokenizer, build_word_tokenizer
from mmgen.outputs.writers import file_sha256
from mmgen.tiny.world import VOCABULARY
from pipelines.tiny_world.data import encode_bank
from pipelines.tiny_world.loops import train_dit, train_vae


@dataclass(frozen=True)
class Schedule:
    """Step counts, batch sizes and latent-bank size.

    Sized so each stage fits one 10-minute call on a lent H100 (see RESULTS.md section 11 for the
    measured seconds). A CPU is far too slow for the VAE stage (tens of seconds per step: conv3d
    backward); use a tiny --scale there only to check the code.
    """

    vae_steps: int = 1400
    vae_batch: int = 32
    bank: int = 48000
    dit_steps: int = 6000
    dit_batch: int = 256

    def scaled(self, scale: float) -> Schedule:
        """Steps and bank times `scale`, batches times min(1, 10 * scale) (0.01: a GPU smoke run)."""
        batch = min(1.0, 10 * scale)
        return Schedule(
            vae_steps=max(1, round(self.vae_steps * scale)),
            vae_batch=max(2, round(self.vae_batch * batch)),
            bank=max(64, round(self.bank * scale)),
            dit_steps=max(1, round(self.dit_steps * scale)),
            dit_batch=max(4, round(self.dit_batch * batch)),
        )


def configure_determinism(device: torch.device) -> None:
    """Ask torch for deterministic kernels (warn, not fail, where an op has none)."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = True  # deterministic too, and the model is trained in float32
    torch.use_deterministic_algorithms(True, warn_only=True)


def _cpu_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in module.state_dict().items()}


STAGES = ("all", "vae", "dit")
VAE_STAGE = "vae_stage.json"  # what `--stage vae` writes next to vae.safetensors: its curve and seconds


def train(
    out: Path,
    *,
    seed: int = 0,
    scale: float = 1.0,
    device: str = "auto",
    max_seconds: float | None = None,
    stage: str = "all",
    vae_dir: Path | None = None,
) -> dict:
    """Run the stages and write DIR/model.json + {vae,transformer,text_encoder}.safetensors.

    stage 'vae' writes only DIR/vae.safetensors and DIR/vae_stage.json; stage 'dit' takes those from
    `vae_dir` and writes the whole model, the same bytes as stage 'all' with the same seed and scale.
    max_seconds: a safety cap for lent machines (per stage: 'all' gives the VAE at most 45% of it); a
    capped run stops a stage early and says so in the log and the curve. None: the full schedule.
    """
    if stage not in STAGES:
        raise ValueError(f"stage = {stage!r}; allowed: {', '.join(STAGES)}")
    if (stage == "dit") != (vae_dir is not None):
        raise ValueError(
            "--vae DIR goes with --stage dit (and only with it): the VAE stage's output directory"
        )
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    if not set(VOCABULARY) <= set(WORDS):
        raise ValueError(f"the world's words {sorted(set(VOCABULARY) - set(WORDS))} are not tokenizer words")
    configure_determinism(dev)
    started = time.time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plan = Schedule().scaled(scale)
    print(f"device {dev}  stage {stage}  schedule {plan}", flush=True)
    cap = math.inf if max_seconds is None else max_seconds
    curve: list = []
    if stage == "dit":
        vae, curve, vae_seconds = load_vae_stage(Path(vae_dir), seed, scale, dev)
    else:
        vae = train_vae(
            seed, plan.vae_steps, plan.vae_batch, dev, curve, started + (0.45 if stage == "all" else 1) * cap
        )
        vae_seconds = time.time() - started
        print(f"vae done at {vae_seconds:.0f} s", flush=True)
        if stage == "vae":
            save_file(_cpu_state(vae), str(out / "vae.safetensors"), metadata={"format": "pt"})
            stage_record = {"seed": seed, "scale": scale, "seconds": round(vae_seconds, 1), "curve": curve}
            (out / VAE_STAGE).write_text(json.dumps(stage_record, indent=1, sort_keys=True) + "\n")
            print(f"wrote {out / 'vae.safetensors'}", flush=True)
            return stage_record
    dit_started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        build_word_tokenizer(list(WORDS), Path(tmp), model_max_length=TRANSFORMER.text_len)
        tokenizer = TextTokenizer.from_dir(Path(tmp))
    latents, captions = encode_bank(vae, seed, plan.bank, dev)
    # Rounded before use, so the statistics written to the VAE config are exactly those trained with.
    mean = [round(v, 6) for v in latents.mean(dim=(0, 2, 3, 4)).tolist()]
    std = [round(v, 6) for v in latents.std(dim=(0, 2, 3, 4)).tolist()]
    latents = (latents - torch.tensor(mean, device=dev).view(1, -1, 1, 1, 1)) / torch.tensor(
        std, device=dev
    ).view(1, -1, 1, 1, 1)
    print(f"latent bank {tuple(latents.shape)}  mean {mean}  std {std}", flush=True)

    dit, encoder = train_dit(
        latents,
        captions,
        tokenizer,
        seed,
        plan.dit_steps,
        plan.dit_batch,
        dev,
        curve,
        dit_started + cap,
    )
    seconds = vae_seconds + time.time() - dit_started
    return export(out, vae, dit, encoder, mean, std, record(seed, scale, plan, dev, seconds, curve))


def load_vae_stage(
    directory: Path, seed: int, scale: float, dev: torch.device
) -> tuple[torch.nn.Module, list, float]:
    """A `--stage vae` output -> (the VAE in eval mode on `dev`, its curve, its seconds); the seed and
    scale must be the ones this run uses, or the split run would not equal `--stage all`."""
    record_path = directory / VAE_STAGE
    if not record_path.is_file() or not (directory / "vae.safetensors").is_file():
        raise FileNotFoundError(
            f"{directory}: no {VAE_STAGE} + vae.safetensors (run --stage vae --out {directory})"
        )
    stage_record = json.loads(record_path.read_text())
    if (stage_record["seed"], stage_record["scale"]) != (seed, scale):
        raise ValueError(
            f"{record_path}: VAE trained with seed {stage_record['seed']} scale {stage_record['scale']}, "
            f"this run has seed {seed} scale {scale}"
        )
    vae = AutoencoderKLWan(**copy.deepcopy(VAE), latents_mean=[0.0] * Z_DIM, latents_std=[1.0] * Z_DIM)
    vae.load_state_dict(load_file(str(directory / "vae.safetensors")))
    return vae.to(dev).eval(), list(stage_record["curve"]), float(stage_record["seconds"])


def record(seed: int, scale: float, plan: Schedule, dev: torch.device, seconds: float, curve: list) -> dict:
    """The training run as model.json records it (how to reproduce it, where it ran, its loss curve)."""
    return {
        "command": f"python3 -m pipelines.tiny_world.train --out DIR --seed {seed} --scale {scale}",
        "seed": seed,
        "schedule": asdict(plan),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "seconds": round(seconds, 1),
        "curve": curve,
    }


def export(
    out: Path,
    vae: torch.nn.Module,
    dit: torch.nn.Module,
    encoder: torch.nn.Module,
    mean: list[float],
    std: list[float],
    training: dict,
) -> dict:
    """Write {vae,transformer,text_encoder}.safetensors (float32) and model.json into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    digests = {}
    for name, module in (("vae", vae), ("transformer", dit), ("text_encoder", encoder)):
        path = out / f"{name}.safetensors"
        save_file(_cpu_state(module), str(path), metadata={"format": "pt"})
        digests[path.name] = file_sha256(path)
    manifest = {"latents_mean": mean, "latents_std": std, "sha256": digests, "training": training}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}: {json.dumps(digests)}", flush=True)
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python3 -m pipelines.tiny_world.train", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for model.json and the weights")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply step counts and data (0.05: quick check)"
    )
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    parser.add_argument("--max-seconds", type=float, default=None, help="safety cap (stops stages early)")
    parser.add_argument("--stage", choices=STAGES, default="all", help="run one stage (one GPU call each)")
    parser.add_argument("--vae", type=Path, default=None, help="with --stage dit: the --stage vae output")
    args = parser.parse_args(argv)
    train(
        args.out,
        seed=args.seed,
        scale=args.scale,
        device=args.device,
        max_seconds=args.max_seconds,
        stage=args.stage,
        vae_dir=args.vae,
    )


if __name__ == "__main__":
    main()
