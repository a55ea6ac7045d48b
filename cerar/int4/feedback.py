"""Error feedback for the two-shot all-reduces: what each rank's roundings dropped, added back at its next call.

A rank rounds two kinds of message (``cerar.int4.two_shot``): its contribution to every other rank's shard (shot 1)
and, as a shard's owner, the reduced shard (shot 2). With feedback, rank i sends Q(x + e) where x is what it means to
send and e what its last message of that shard dropped, and keeps e' = (x + e) - Q(x + e) for the next call. For the
mean's shard j, with C_j = sum_{i != j} c_i,j / N (the senders' residuals, in the mean's units) and r_j the owner's,

    out_t = g_bar_t + E_t - E_{t+1},   E_t = C_j + r_j        (up to float32's rounding of the sums)

so the error of the sum of the aggregates over any window of consecutive calls is E_first - E_after: bounded by the
residuals (each within one step of its rounding), where without feedback it grows with the window. Each rank
keeps one residual per place it rounds (``rows``: a name, e.g. "flat", "node" or "rail", and a shape), zero at the
first call, and must make the same calls in the same order at every step; ``state_dict`` is what a checkpoint keeps
of it (per rank), so a resumed run continues bit for bit.
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    """This rank's residuals, by the name of the place they round (module docstring)."""

    def __init__(self):
        self.residuals: dict[str, torch.Tensor] = {}

    def rows(self, name: str, parts: int, s: int, like: torch.Tensor) -> torch.Tensor:
        """The residual of place ``name``, [parts, s] float32 on ``like``'s device (zeros at first use); a
        ValueError naming the place when it was kept for another shape (another tensor's length: the residual would
        be added to the wrong values)."""
        kept = self.residuals.get(name)
        if kept is None:
            kept = self.residuals[name] = torch.zeros(parts * s, dtype=torch.float32, device=like.device)
        if kept.numel() != parts * s:
            raise ValueError(
                f"error feedback: the residual of {name!r} holds {kept.numel()} values, but this call rounds "
                f"{parts} x {s}: one feedback state serves one tensor length per place"
            )
        if kept.device != like.device:
            kept = self.residuals[name] = kept.to(like.device)
        return kept.view(parts, s)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The residuals on the CPU (a checkpoint's per-rank part)."""
        return {name: value.detach().cpu().clone() for name, value in self.residuals.items()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"error feedback: a state must map names to tensors, got {type(state).__name__}")
        self.residuals = {name: value.to(torch.float32).clone() for name, value in state.items()}


class BucketFeedback:
    """Error feedback for a DDP communication hook: one `ErrorFeedback` per gradient bucket, by DDP's bucket index.

    A bucket is one call of the all-reduce, so its residuals are kept for it alone. This needs the same buckets at
    every step of every launch, which the trainer gives it: DDP's buckets are settled before the first step and the
    hook is registered after (train/loop.py, `Trainer.settle_ddp_buckets`); a bucket whose length changed is refused
    by `ErrorFeedback.rows`, naming it."""

    def __init__(self):
        self.buckets: dict[int, ErrorFeedback] = {}

    def of(self, index: int) -> ErrorFeedback:
        """The residuals of bucket ``index`` (empty at its first call)."""
        if index not in self.buckets:
            self.buckets[index] = ErrorFeedback()
        return self.buckets[index]

    def state_dict(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every bucket's residuals on the CPU (a checkpoint's per-rank part)."""
        return {index: feedback.state_dict() for index, feedback in sorted(self.buckets.items())}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or not all(isinstance(k, int) for k in state):
            raise ValueError(
                "error feedback: a DDP hook's state maps bucket indices to residuals; this one does not (a checkpoint "
                "of the flat aggregation, trainer.overlap=false?)"
            )
        self.buckets = {}
        for index, residuals in state.items():
            self.of(index).load_state_dict(residuals)


def bucket_feedback(feedback: BucketFeedback | None, bucket) -> ErrorFeedback | None:
    """The residuals of DDP bucket ``bucket`` (a ``dist.GradBucket``), or None when the hook does not feed back."""
    return None if feedback is None else feedback.of(bucket.index())


__all__ = ["BucketFeedback", "ErrorFeedback", "bucket_feedback"]
