"""UniPC (Zhao et al. 2023, "UniPC: A Unified Predictor-Corrector Framework") on flow-matching sigmas.

The scheduler Wan checkpoints ship (diffusers' UniPCMultistepScheduler with use_flow_sigmas,
prediction_type flow_prediction, predict_x0), written here so a Wan text-to-video run needs no
diffusers import (~2.5 s on a 2-core CPU: its package, scipy.stats, torch._dynamo). The arithmetic
is diffusers' own, op for op, in the same dtypes (the schedule in float64 numpy, then float32
sigmas; the update in torch on 0-dim float32 tensors): the same latents bit for bit
(tests/test_unipc_flow.py). Configs outside this subset (karras / exponential / beta sigmas,
dynamic shifting, thresholding, a solver_p, ...) are answered by `fits` = False; the loader uses
diffusers' class for those.

On flow sigmas alpha_t = 1 - sigma, sigma_t = sigma, lambda = log(alpha_t) - log(sigma_t); the
model's flow prediction v gives the data prediction x0 = x - sigma * v. Each step corrects the
sample just predicted (UniC, using the new model output) and then predicts the next one (UniP).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

CLASS_NAME = "UniPCMultistepScheduler"
# Keys of diffusers' config that do not change the flow-sigma arithmetic (the VP-schedule betas are
# computed by diffusers but unused once sigmas are flow sigmas; timesteps come from the sigmas), with
# diffusers' defaults (what a written scheduler_config.json holds).
UNUSED = {
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "trained_betas": None,
    "timestep_spacing": "linspace",
    "steps_offset": 0,
    "rescale_betas_zero_snr": False,
    "dynamic_thresholding_ratio": 0.995,
    "sample_max_value": 1.0,
    "time_shift_type": "exponential",
}
# Keys whose value must be exactly this for the subset written here.
REQUIRED = {
    "use_flow_sigmas": True,
    "prediction_type": "flow_prediction",
    "predict_x0": True,
    "thresholding": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "use_dynamic_shifting": False,
    "shift_terminal": None,
    "solver_p": None,
    "sigma_min": None,
    "sigma_max": None,
}


@dataclass(frozen=True)
class FlowUniPCConfig:
    """The settings that shape the schedule and the update (diffusers' names and defaults)."""

    num_train_timesteps: int = 1000
    solver_order: int = 2
    solver_type: str = "bh2"  # "bh1": B(h) = h; "bh2": B(h) = e^h - 1
    lower_order_final: bool = True
    disable_corrector: tuple[int, ...] = ()
    flow_shift: float = 1.0
    final_sigmas_type: str = "zero"  # the sigma after the last step: 0, or the last step's own

    def __post_init__(self) -> None:
        if self.solver_type not in ("bh1", "bh2"):
            raise ValueError(f"solver_type {self.solver_type!r}; allowed: bh1, bh2")
        if self.final_sigmas_type not in ("zero", "sigma_min"):
            raise ValueError(f"final_sigmas_type {self.final_sigmas_type!r}; allowed: zero, sigma_min")
        if self.solver_order < 1 or self.num_train_timesteps < 1:
            raise ValueError(
                f"solver_order {self.solver_order}, num_train_timesteps {self.num_train_timesteps}"
            )

    def to_diffusers(self) -> dict[str, Any]:
        """Every UniPCMultistepScheduler argument of this config (as its scheduler_config.json holds them)."""
        values = dataclasses.asdict(self)
        return {**UNUSED, **REQUIRED, **values, "disable_corrector": list(self.disable_corrector)}


FIELDS = {field.name for field in dataclasses.fields(FlowUniPCConfig)}


def fits(config: Mapping[str, Any]) -> bool:
    """Whether a diffusers scheduler_config.json (a dict) is a UniPC config this module computes exactly."""
    if config.get("_class_name", CLASS_NAME) != CLASS_NAME:
        return False
    for key, value in config.items():
        if key.startswith("_") or key in UNUSED or key in FIELDS:
            continue
        if key not in REQUIRED or value != REQUIRED[key]:
            return False
    return all(
        config.get(key, REQUIRED[key]) == REQUIRED[key] for key in ("use_flow_sigmas", "prediction_type")
    )


class FlowUniPCScheduler:
    """One request's UniPC state: set_timesteps, then step() once per timestep in order.

    The surface the pipelines use of diffusers' schedulers: from_config, config.num_train_timesteps,
    set_timesteps(n, device), set_begin_index, timesteps, step(model_output, timestep, sample,
    return_dict=False) -> (prev_sample,).
    """

    def __init__(self, config: FlowUniPCConfig) -> None:
        self.config = config
        self.timesteps = torch.empty(0, dtype=torch.int64)
        self.sigmas = torch.empty(0)
        self.model_outputs: list[torch.Tensor | None] = [None] * config.solver_order
        self.lower_order_nums = 0
        self.last_sample: torch.Tensor | None = None
        self.this_order = 1
        self.step_index: int | None = None
        self.begin_index: int | None = None

    @classmethod
    def from_config(cls, config: FlowUniPCConfig | Mapping[str, Any]) -> FlowUniPCScheduler:
        """A fresh scheduler from a FlowUniPCConfig or a diffusers config dict (which must `fits`)."""
        if isinstance(config, FlowUniPCConfig):
            return cls(config)
        if not fits(config):
            raise ValueError(f"not a flow UniPC config this scheduler computes: {dict(config)!r}")
        values = {key: config[key] for key in FIELDS if key in config}
        values["disable_corrector"] = tuple(values.get("disable_corrector", ()))
        return cls(FlowUniPCConfig(**values))

    def set_begin_index(self, begin_index: int = 0) -> None:
        self.begin_index = begin_index

    def set_timesteps(self, num_inference_steps: int, device: str | torch.device | None = None) -> None:
        """The shifted flow sigmas of `num_inference_steps` steps (+ the final one) and their timesteps."""
        config = self.config
        sigmas = np.linspace(1, 1 / config.num_train_timesteps, num_inference_steps + 1)[:-1]
        shift = config.flow_shift
        sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
        if np.fabs(sigmas[0] - 1) < 1e-6:
            sigmas[0] -= 1e-6  # log(alpha) of the first step would be log(0)
        timesteps = (sigmas * config.num_train_timesteps).copy()
        last = sigmas[-1] if config.final_sigmas_type == "sigma_min" else 0
        self.sigmas = torch.from_numpy(np.concatenate([sigmas, [last]]).astype(np.float32))
        self.timesteps = torch.from_numpy(timesteps).to(device=device, dtype=torch.int64)
        self.model_outputs = [None] * config.solver_order
        self.lower_order_nums = 0
        self.last_sample = None
        self.step_index = None
        self.begin_index = None

    def step(
        self, model_output: torch.Tensor, timestep: Any, sample: torch.Tensor, return_dict: bool = False
    ) -> tuple[torch.Tensor]:
        """Flow prediction v [B, C, ...] at `timestep` for `sample` -> (the sample at the next timestep,)."""
        if return_dict:
            raise ValueError("FlowUniPCScheduler.step returns a tuple: pass return_dict=False")
        if len(self.timesteps) == 0:
            raise ValueError("set_timesteps must run before step")
        if self.step_index is None:
            self.step_index = self.begin_index if self.begin_index is not None else self._index_of(timestep)
        config = self.config
        index = self.step_index
        corrects = index > 0 and index - 1 not in config.disable_corrector and self.last_sample is not None
        x0 = sample - self.sigmas[index] * model_output  # the data prediction
        if corrects:
            sample = self._update(
                x0, self.last_sample, index - 1, self.this_order, corrector=True, new=sample
            )
        self.model_outputs = [*self.model_outputs[1:], x0]
        order = config.solver_order
        if config.lower_order_final:
            order = min(order, len(self.timesteps) - index)
        self.this_order = min(order, self.lower_order_nums + 1)  # warm-up: the first steps lower order
        self.last_sample = sample
        prev = self._update(x0, sample, index, self.this_order, corrector=False)
        self.lower_order_nums = min(self.lower_order_nums + 1, config.solver_order)
        self.step_index = index + 1
        return (prev,)

    def _index_of(self, timestep: Any) -> int:
        # diffusers' rule: the second match when the schedule repeats a timestep, the last index if none.
        found = (self.timesteps == timestep).nonzero()
        if len(found) == 0:
            return len(self.timesteps) - 1
        return int(found[1 if len(found) > 1 else 0].item())

    def _lambda(self, index: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(alpha, sigma, lambda = log alpha - log sigma) at sigmas[index], 0-dim float32 on device."""
        sigma = self.sigmas[index].to(device)
        alpha = 1 - sigma
        return alpha, sigma, torch.log(alpha) - torch.log(sigma)

    def _update(
        self,
        model_t: torch.Tensor,
        x: torch.Tensor,
        s0: int,
        order: int,
        *,
        corrector: bool,
        new: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """UniP (predictor: x at sigmas[s0] -> sigmas[s0 + 1]) or UniC (corrector: recomputes the step
        s0 -> s0 + 1 taken from x with the new data prediction model_t at s0 + 1; `new` is that step's
        predicted sample, whose dtype the result keeps). model_outputs[-1] is the data prediction at s0."""
        device = x.device if new is None else new.device
        outputs = self.model_outputs
        m0 = outputs[-1]
        alpha_t, sigma_t, lambda_t = self._lambda(s0 + 1, device)
        _, sigma_s0, lambda_s0 = self._lambda(s0, device)
        h = lambda_t - lambda_s0
        rks, d1s = [], []
        for i in range(1, order):
            lambda_si = self._lambda(s0 - i, device)[2]
            rk = (lambda_si - lambda_s0) / h
            rks.append(rk)
            d1s.append((outputs[-(i + 1)] - m0) / rk)
        rks.append(torch.ones((), device=device))
        rks = torch.stack(rks)
        hh = -h  # predict_x0
        h_phi_1 = torch.expm1(hh)  # e^h - 1
        h_phi_k = h_phi_1 / hh - 1
        factorial = 1
        b_h = hh if self.config.solver_type == "bh1" else torch.expm1(hh)
        rows, b = [], []
        for i in range(1, order + 1):
            rows.append(torch.pow(rks, i - 1))
            b.append(h_phi_k * factorial / b_h)
            factorial *= i + 1
            h_phi_k = h_phi_k / hh - 1 / factorial
        r = torch.stack(rows)
        b = torch.stack(b)
        dtype = x.dtype
        d1s = torch.stack(d1s, dim=1) if d1s else None  # [B, K, C, ...]
        x_t_ = sigma_t / sigma_s0 * x - alpha_t * h_phi_1 * m0
        if corrector:
            rhos = torch.ones(1, dtype=dtype, device=device) * 0.5 if order == 1 else self._solve(r, b, dtype)
            res = torch.einsum("k,bkc...->bc...", rhos[:-1], d1s) if d1s is not None else 0
            x_t = x_t_ - alpha_t * b_h * (res + rhos[-1] * (model_t - m0))
        else:
            if d1s is None:
                res = 0
            else:
                rhos = (
                    torch.ones(1, dtype=dtype, device=device) * 0.5
                    if order == 2
                    else self._solve(r[:-1, :-1], b[:-1], dtype)
                )
                res = torch.einsum("k,bkc...->bc...", rhos, d1s)
            x_t = x_t_ - alpha_t * b_h * res
        return x_t.to(dtype)

    @staticmethod
    def _solve(r: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.linalg.solve(r, b).to(r.device).to(dtype)
