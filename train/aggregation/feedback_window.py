"""How the per-tensor criterion judges an aggregate whose error is fed back: over a window of consecutive steps.

With error feedback (`aggregator.error_feedback=true`, `cerar.int4.feedback`) a step's aggregate is
g_hat_t = g_bar_t + E_t - E_{t+1}: its error is what the last step's roundings dropped minus what this one drops, so
consecutive errors are not independent (they cancel), and one step's figure says nothing of what the optimizer
integrates. The criterion is therefore taken on the sum of W consecutive steps, the yardstick summed alike: for each
parameter tensor t,

    rho_t(W) = || sum_{steps} (g_hat_t - g_bar_t) || / sqrt( sum_{steps} sigma_t^2 )

(sigma_t the step's noise of g_bar_t, train/aggregation/tensor_errors.py; the steps' noises are independent, so the
summed gradient's noise is the root of the summed variances). Fed back, the numerator is E_first - E_after whatever
W, so rho_t(W) falls as 1/sqrt(W); without feedback, with stochastic rounding, the errors are independent and
rho_t(W) stays one step's rho_t; with a bias (nearest rounding) it grows as sqrt(W). W defaults to 10 steps, the
horizon of Adam's first moment at beta1 = 0.9 (1 / (1 - beta1)): what the update averages over.

The trainer records, at the last step of each window (steps k W, counted from 1), `feedback/window_error_to_noise_max`
(the worst tensor's rho_t(W), the worst rank's), `feedback/window_worst_tensor` and `window/<tensor>` for each
tensor, beside the one-step `agg/` and `tensor/` figures, which under feedback are not the criterion. A window needs
every one of its steps measured, each against an exact all-reduce of the same gradients (about one more all-reduce
a measured step): `trainer.measure_error_every=1` measures every step and so every window; `measure_error_every=M`,
a multiple of W, measures only the W steps of the window that ends at each multiple of M (`measured_step`), so a
run pays for W steps in M, the one-step figures of `measure_error_every` without feedback, and still gets whole
windows. A window broken by a skipped step (a non-finite gradient) or by a resume in its middle is not reported.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from train.aggregation.tensor_errors import TensorLayout, ratio_to_noise, tensor_noise
from train.config import feedback_window_steps
from train.distributed import bounded


def measured_step(step: int, every: int, window: int | None) -> bool:
    """Whether step ``step`` (counted from 1) is measured at ``trainer.measure_error_every=every``: without windows
    (``window`` None) each every-th step; with windows of ``window`` steps, the ``window`` steps that end at each
    multiple of ``every`` (steps kM - W + 1 .. kM; a multiple of W, so each such run of steps is one whole window;
    every step at ``every`` = 1 or W); never at ``every`` = 0."""
    if every <= 0:
        return False
    if window is None:
        return step % every == 0
    return (step - 1) % every >= every - window


class FeedbackWindow:
    """The running sums of one window (module docstring): every rank calls ``add`` at every measured step."""

    def __init__(self, layout: TensorLayout, window: int):
        if window < 1:
            raise ValueError(f"FeedbackWindow: a window of {window} steps (need >= 1)")
        self.layout, self.window = layout, window
        self.error: torch.Tensor | None = None  # sum of g_hat - g_bar over the window's steps so far
        self.noise_squared = torch.zeros(len(layout.sizes), dtype=torch.float64)
        self.last_step = None  # the last step added to the open window (None: no window open)

    def add(self, step: int, local: torch.Tensor, aggregated: torch.Tensor, exact: torch.Tensor) -> dict:
        """Add step ``step``'s error and noise; at a window's last step, its figures (else {})."""
        noise = tensor_noise(local, exact, self.layout)  # collective: every rank, every measured step
        if (step - 1) % self.window == 0:  # a window opens
            self.error = torch.zeros_like(exact)
            self.noise_squared.zero_()
        elif self.last_step is None or step != self.last_step + 1:  # a window broken, or opened before a resume
            self.last_step = None
            return {}
        self.error.add_(aggregated - exact)
        self.noise_squared += noise.square()
        self.last_step = step
        if step % self.window:
            return {}
        self.last_step = None
        ratio = ratio_to_noise(self.layout.squared_norms(self.error).cpu(), self.noise_squared.sqrt())
        worst = ratio.to(exact.device)
        bounded("feedback window all_reduce", lambda: dist.all_reduce(worst, dist.ReduceOp.MAX, async_op=True))
        ratio = worst.cpu()
        at = int(ratio.nan_to_num(math.inf).argmax())
        record = {
            "feedback/window_steps": self.window,
            "feedback/window_error_to_noise_max": float(ratio[at]),
            "feedback/window_worst_tensor": self.layout.names[at],
        }
        record.update({f"window/{name}": float(r) for name, r in zip(self.layout.names, ratio.tolist(), strict=True)})
        return record


def feedback_window(a, layout: TensorLayout) -> FeedbackWindow | None:
    """The trainer's window for aggregator config ``a``, of ``feedback_window_steps(a)`` steps; None (no windows)
    where that is None."""
    window = feedback_window_steps(a)
    return None if window is None else FeedbackWindow(layout, window)


__all__ = ["FeedbackWindow", "feedback_window", "measured_step"]
