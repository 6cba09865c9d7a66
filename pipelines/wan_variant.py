"""Which Wan variant a pipeline runs, as one frozen value read once from its components.

- T2V (Wan2.1, Wan2.2 A14B): text only; the noise is the DiT's whole input.
- I2V (Wan2.1 I2V, Wan2.2 I2V-A14B): an image is required; its VAE latents and a frame mask are
  concatenated to the noise along channels (in_channels = 2 * z_dim + the VAE's temporal stride);
  Wan2.1 I2V also attends to the image's CLIP tokens (the transformer's image path).
- TI2V (Wan2.2 TI2V-5B, expand_timesteps): an image is optional; when given, its latents replace
  the first latent frame, whose tokens run at timestep 0 while the rest run at t.
- VACE (Wan2.1 VACE, a WanVACEDiT): text-to-video plus a control context (a control video, a
  per-pixel mask, reference images; pipelines.vace_conditioning) built once per request and read by
  the transformer's VACE blocks; reference frames lead the latents and are dropped before decode.
- Two experts (Wan2.2 A14B, boundary_ratio): `transformer` serves t >= boundary_ratio *
  num_train_timesteps, `transformer_2` the rest, each with its own guidance scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmgen.errors import ValidationError
from pipelines.capabilities import Capabilities

ImageMode = Literal["none", "concat", "first_frame"]
# The tasks of each image mode (pipelines.capabilities.TASKS); Wan T2I is Wan at one frame.
MODE_TASKS = {"none": ("t2v", "t2i"), "concat": ("i2v",), "first_frame": ("t2v", "ti2v", "t2i")}


@dataclass(frozen=True)
class WanVariant:
    """image_mode: how an image conditions ('none', 'concat' = I2V, 'first_frame' = TI2V).

    image_embeddings: the transformer attends to CLIP image tokens (Wan2.1 I2V). mask_channels: the
    frame-mask channels of the I2V concat (the VAE's temporal stride). boundary_ratio: None for one
    expert, else Wan2.2's switch point.
    """

    image_mode: ImageMode = "none"
    image_embeddings: bool = False
    mask_channels: int = 0
    boundary_ratio: float | None = None
    control: bool = False

    @staticmethod
    def of(
        *,
        in_channels: int,
        z_dim: int,
        temporal_stride: int,
        expand_timesteps: bool,
        image_dim: int | None,
        boundary_ratio: float | None,
        control: bool = False,
    ) -> WanVariant:
        """The variant of a transformer with `in_channels` over a VAE with `z_dim` latent channels."""
        if expand_timesteps:
            mode: ImageMode = "first_frame"
        elif in_channels == z_dim:
            mode = "none"
        elif in_channels == 2 * z_dim + temporal_stride:
            mode = "concat"
        else:
            raise ValidationError(
                f"transformer in_channels {in_channels} fits no Wan variant with vae z_dim {z_dim} "
                f"(allowed: {z_dim} or {2 * z_dim + temporal_stride})"
            )
        if control and (mode != "none" or boundary_ratio is not None):
            raise ValidationError("Wan VACE: only a one-expert text-to-video VACE transformer is supported")
        return WanVariant(
            image_mode=mode,
            image_embeddings=image_dim is not None,
            mask_channels=temporal_stride if mode == "concat" else 0,
            boundary_ratio=boundary_ratio,
            control=control,
        )

    @property
    def experts(self) -> int:
        return 1 if self.boundary_ratio is None else 2

    @property
    def requires_image(self) -> bool:
        return self.image_mode == "concat"

    @property
    def accepts_image(self) -> bool:
        return self.image_mode != "none"

    @property
    def task(self) -> str:
        """'t2v', 'i2v', 'ti2v' or 'vace' (what a request may ask of this checkpoint)."""
        if self.control:
            return "vace"
        return {"none": "t2v", "concat": "i2v", "first_frame": "ti2v"}[self.image_mode]

    def capabilities(self, outputs: str = "video") -> Capabilities:
        """What a checkpoint of this variant does: its tasks, and every feature of the Wan pipeline
        (a second expert only with two)."""
        tasks = ("t2v", "vace") if self.control else MODE_TASKS[self.image_mode]
        return Capabilities.every_feature(outputs, tasks, but=() if self.experts == 2 else ("two_experts",))

    def boundary_timestep(self, num_train_timesteps: int) -> float | None:
        """diffusers' boundary: boundary_ratio * num_train_timesteps (None with one expert)."""
        return None if self.boundary_ratio is None else self.boundary_ratio * num_train_timesteps
