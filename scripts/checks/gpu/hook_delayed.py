"""Section "hook, delayed producer": the DDP hook's CUDA event record (``cerar.ddp.CerarHookState.
submit``) on a bucket whose producing kernel is late.

The bucket is written on the producing (current) stream after a one-second kernel
(``torch.cuda._sleep``); ``submit`` records an event there and the hook's stream waits for it, so
the reduction must read the written bucket, not the zeros before it. On one GPU a hook of a
one-rank group never reads its bucket (``cerar.all_reduce`` returns before any round at N=1, and
NCCL refuses two ranks on one GPU in a communicator), so the check keeps the hook's real
``submit`` (its thread, stream, event record, ``record_stream`` and CUDA-aware future) and gives it
a reduction that reads the bucket: the N logical workers' rounds on the NCCL self-loop
(``selfloop.selfloop_all_reduce``), the bucket holding the N workers' gradients side by side. The
result is held to the spec's protocol in float64 (``tests/spec_reference.py``) within
``cerar.ring.precision.rounding_bound``.

- delayed producer: must PASS;
- control, the event record dropped (``torch.cuda.Event.record`` made a no-op inside ``submit``;
  waiting on an event never recorded returns at once): the same run must then miss the bound;
  PASS when it does, which shows the check can see the fault.

Expected time on one H200: about 25 s (two processes)."""

from __future__ import annotations

from unittest import mock

import torch

from scripts.checks.gpu.cases import FAIL, PASS, Case, Context, Needs

SECTION = "hook, delayed producer"
QUICK = True
EXPECTED_S = 25
NEEDS = Needs(cuda=True, ranks=1)
PROVES = {
    "delayed producer": "the DDP hook's event record makes its stream wait for a late bucket-producing kernel: "
    "the result within the rounding bound of the spec's protocol",
    "control: event record dropped": "without the event record the same run misses the bound (the check sees the "
    "fault)",
}


def cases(ctx: Context) -> list[Case]:  # noqa: ARG001
    kwargs = {"N": 4, "c": 8, "d": 2**18 + 1}
    return [
        Case(SECTION, "delayed producer", "hook_delayed:run", {**kwargs, "drop_event": False}, 90, NEEDS),
        Case(SECTION, "control: event record dropped", "hook_delayed:run", {**kwargs, "drop_event": True}, 90, NEEDS),
    ]


def run(N: int, c: int, d: int, drop_event: bool, out: str) -> dict:  # noqa: ARG001
    import torch.distributed as dist

    import cerar
    from cerar.ddp import CerarHookState
    from scripts.checks.gpu.selfloop import cycles_per_second, one_rank_group, selfloop_all_reduce, sleep, spec_judged

    device = one_rank_group()
    rate = cycles_per_second()
    code = cerar.make_code(N, c, "perturbation", eps=0.05)

    class SelfLoopHookState(CerarHookState):
        """The hook's own ``submit``; the reduction: N logical workers on the self-loop, averaged."""

        def _reduce(self, tensor):
            parts = tensor.view(N, d)
            flats = [parts[i].clone() for i in range(N)]  # on the hook's stream, after its wait for the bucket
            selfloop_all_reduce(flats, code)
            parts.copy_(torch.stack(flats)).div_(N)
            return cerar.AllReduceStats(rounds=code.L)

    state = SelfLoopHookState(exact_ring=True, transport=dist.group.WORLD, timeout=60)
    G = torch.randn(N, d, generator=torch.Generator().manual_seed(3))
    source = G.reshape(-1).to(device)
    bucket = torch.zeros(N * d, device=device)
    torch.cuda.synchronize()
    sleep(1.0, rate)  # the producing kernel is late ...
    bucket.copy_(source)  # ... and writes the bucket after it, on the producing stream
    if drop_event:
        with mock.patch.object(torch.cuda.Event, "record", lambda self, stream=None: None):
            future = state.submit(bucket)
    else:
        future = state.submit(bucket)
    future.wait()  # a CUDA-aware future: the current stream waits for the hook's stream
    result = future.value().view(N, d).cpu()
    judged = spec_judged(result, G, code, scale=1.0 / N)
    missed = not judged["ok"]
    ok = missed if drop_event else judged["ok"]
    return {
        "status": PASS if ok else FAIL,
        "drop_event": drop_event,
        "spec_deviation": judged["spec_deviation"],
        "bound": judged["bound"],
        "error": judged["error"],
        "reason": ""
        if ok
        else (
            f"deviation from the spec {judged['spec_deviation']:.2e}, bound {judged['bound']:.2e}"
            + (": the fault went unseen" if drop_event else "")
        ),
    }


def report(results) -> list[str]:
    lines = []
    for r in results:
        v = r.value or {}
        if "spec_deviation" in v:
            lines.append(
                f"- {r.case.name}: deviation from the spec's protocol {v['spec_deviation']:.2e} (bound "
                f"{v['bound']:.2e}), error against the exact average {v['error']:.2e}: {r.status}."
            )
    return lines + [""]
