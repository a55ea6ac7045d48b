"""fp16 loss scaling as Pythia trained with it: DeepSpeed's dynamic loss scaler, as a torch GradScaler.

Pythia's released configs ask DeepSpeed for `"initial_scale_power": 12, "loss_scale_window": 1000,
"hysteresis": 2, "min_loss_scale": 1`. torch's GradScaler has no hysteresis, so `PythiaLossScaler` keeps
its interface (scale, unscale_, step, state_dict) and replaces `update` with DeepSpeed's rule
(deepspeed/runtime/fp16/loss_scaler.py, DynamicLossScaler.update_scale, consecutive_hysteresis off):

- an overflow (inf/nan in the gradients, the step skipped) halves the scale only when the hysteresis
  budget is down to 1; otherwise it spends one unit of that budget and keeps the scale;
- after `window` iterations without overflow since the last one the scale doubles and the budget is
  refilled to `hysteresis` (only then: a second overflow before the next growth does halve);
- the scale never goes below `min_scale` (DeepSpeed can raise at the minimum instead; here it stays there,
  and the steps keep being skipped, visible as `skipped_steps`).
"""

from __future__ import annotations

import torch


class PythiaLossScaler(torch.amp.GradScaler):
    """A GradScaler whose scale follows DeepSpeed's DynamicLossScaler (with hysteresis and a minimum)."""

    def __init__(
        self, device: str, *, init_scale: float = 2.0**12, window: int = 1000, hysteresis: int = 2, min_scale=1.0
    ):
        super().__init__(device, init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=window)
        self.window, self.hysteresis, self.min_scale = int(window), int(hysteresis), float(min_scale)
        self.hysteresis_left = self.hysteresis
        self.iteration, self.last_overflow_iteration = 0, -1

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if new_scale is not None or not self.is_enabled():
            super().update(new_scale)
            return
        found = [f for state in self._per_optimizer_states.values() for f in state["found_inf_per_device"].values()]
        if not found:
            raise AssertionError("No inf checks were recorded prior to update.")
        overflow = sum(float(f.item()) for f in found) > 0
        scale = self.get_scale()
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                scale = max(scale / 2.0, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        elif (self.iteration - self.last_overflow_iteration) % self.window == 0:
            self.hysteresis_left = self.hysteresis
            scale *= 2.0
        self.iteration += 1
        super().update(new_scale=float(scale))  # sets the scale and clears this iteration's inf checks

    def state_dict(self) -> dict:
        state = super().state_dict()
        if state:
            state.update(
                hysteresis_left=self.hysteresis_left,
                iteration=self.iteration,
                last_overflow_iteration=self.last_overflow_iteration,
            )
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.hysteresis_left = int(state_dict.get("hysteresis_left", self.hysteresis))
        self.iteration = int(state_dict.get("iteration", 0))
        self.last_overflow_iteration = int(state_dict.get("last_overflow_iteration", -1))


def build_loss_scaler(t, device: torch.device) -> PythiaLossScaler:
    """The fp16 scaler of trainer config `t` (defaults: Pythia's)."""
    return PythiaLossScaler(
        device.type,
        init_scale=2.0**t.fp16_initial_scale_power,
        window=t.fp16_loss_scale_window,
        hysteresis=t.fp16_hysteresis,
        min_scale=t.fp16_min_loss_scale,
    )
