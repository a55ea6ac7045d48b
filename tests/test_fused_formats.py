"""The fused kernels (cerar.formats.fused) against the eager formats they replace, byte for byte, and enable's choice.

The suite compiles with torch.compile's "eager" backend (dynamo traces each kernel's function, torch's own
operations run it: seconds, where inductor's C++ build takes minutes on 2 cores; tests/conftest.py). That holds
the kernels' arithmetic and the dispatch to the eager bytes; what a backend's code generation could change
(a division or a contraction rounded otherwise) is excluded by how the kernels are written (the module docstring)
and caught, where it happens, by ``enable``'s own check before a kernel is switched on: the tests here plant
kernels that round one unit otherwise and see the check refuse them. The inductor build itself is checked the
same way by ``enable`` on every machine that compiles it (the GPU check, scripts/bench/format_timing.py,
scripts/bench/bench_arithmetic.py).
"""

from __future__ import annotations

import pytest
import torch

from cerar.formats import devices, fused
from cerar.formats import int8_blocks as q8
from cerar.formats.wire import Wire
from tests.test_int8_format import adversarial, check_bytes

B = 128


@pytest.fixture
def traced(monkeypatch):
    """Kernels switched on by ``enable`` with the "eager" backend; ``traced(**kw)`` enables, returns its lines."""
    monkeypatch.delenv("CERAR_FUSED", raising=False)  # the suite's runs are eager (tests/conftest.py); not here
    fused.disable()

    def switch_on(**kw):
        lines = []
        kw = {"backend": "eager", "pick": "fused", "say": lines.append, **kw}
        fused.enable("cpu", B, **kw)
        return lines

    yield switch_on
    fused.disable()


def assert_dispatch_writes_the_eager_bytes(sizes) -> None:
    """quantize_into (the fused dispatch) and quantize_eager write the same message at each size; the 16-bit
    encode likewise, both wire dtypes. Non-finite blocks excluded (their integers are unspecified)."""
    for s in sizes:
        x = adversarial(B, s, seed=s % 97)
        finite = torch.isfinite(torch.nn.functional.pad(x, (0, -s % B)).view(-1, B)).all(dim=1)
        for rounding in ("nearest", "stochastic"):
            got, want = q8.new_message(s, B, "cpu"), q8.new_message(s, B, "cpu")
            q8.quantize_into(got, x, B, rounding, q8.dither_key(s))
            q8.quantize_eager(want, x, B, rounding, q8.dither_key(s))
            (scales_g, values_g), (scales_w, values_w) = q8.parts(got, s, B), q8.parts(want, s, B)
            assert torch.equal(scales_g[finite], scales_w[finite]), (s, rounding)
            rows = finite.repeat_interleave(B)[:s]
            assert torch.equal(values_g[rows], values_w[rows]), (s, rounding)
        y = x.nan_to_num(0.0, 0.0, 0.0)
        for dtype in ("float16", "bfloat16"):
            wire = Wire(dtype)
            got, want = wire.empty(s, y), wire.empty(s, y)
            wire.encode(y, got)
            wire.encode_eager(y, want)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (s, dtype)


def test_the_traced_kernels_write_the_eager_bytes_at_odd_sizes(traced):
    """Sizes at and above the dispatch's threshold, with short last blocks and without, across dither chunks (2^16
    values): the fused path (one kernel per message, the last block padded inside it) writes the eager bytes, and
    the format's (the float64 reference of tests/test_int8_format.py), and nothing compiles after ``enable``
    (a compile inside a collective would hold the peers past their deadlines)."""
    from torch._dynamo.utils import counters  # dynamo: seconds to import, not at collection

    traced(sample_values=2 * fused.MIN_VALUES)
    assert sorted(k for k, _, _ in fused.enabled()) == sorted(fused.COMPILED)
    graphs = counters["stats"]["unique_graphs"]
    sizes = (fused.MIN_VALUES, fused.MIN_VALUES + 1, 2**16 - 3, 2**16 + 3 * B + 5, 2**17 + 37, 2**17 + 9 * B)
    assert_dispatch_writes_the_eager_bytes(sizes)
    assert counters["stats"]["unique_graphs"] == graphs  # enable compiled every graph a length needs
    x = adversarial(B, sizes[-1], seed=4)
    message = q8.new_message(x.numel(), B, "cpu")
    q8.quantize_into(message, x, B, "stochastic", 777)
    check_bytes(message, x, B, "stochastic", 777)


def test_the_traced_kernels_pass_enables_check_at_2_24_values(traced):
    """Issue 52: the bytes held on 2^24 + 5 B + 37 values (enable's own sample, built so that every value of half
    its blocks lies within a few units of a rounding boundary; a short last block; 257 dither chunks) and on two
    shorter messages, one a whole number of blocks, every kernel through its dispatch."""
    lines = traced()
    assert sorted(k for k, _, _ in fused.enabled()) == sorted(fused.COMPILED), lines
    assert f"checked on {fused.SAMPLE_VALUES} values" in lines[0] and fused.SAMPLE_VALUES > 2**24


def one_unit_off(every: int, first: int):
    """A nearest kernel whose inverse is one unit larger in blocks first, first + every, ... (as a division
    rounded otherwise would be), and a stochastic one whose products reach the sum unrounded (as a contraction
    into a fused multiply-add would): the two ways a backend could round otherwise."""

    def nearest(block):
        def kernel(x, values):
            rows = fused._rows(x, block)
            scale, p, inverse = fused._per_block(rows)
            off = torch.zeros_like(inverse, dtype=torch.bool)
            off[first::every] = True
            inverse = torch.where(off, torch.nextafter(inverse, torch.full_like(inverse, float("inf"))), inverse)
            r = (rows * p.unsqueeze(1)) * inverse.unsqueeze(1)
            values.copy_(r.round().clamp(-127, 127).to(torch.int8).view(-1)[: x.shape[0]])
            return scale, p, inverse

        return kernel

    def stochastic(block):
        def kernel(x, values, table, shifts):
            rows = fused._rows(x, block)
            scale, p, inverse = fused._per_block(rows)
            K = table.shape[0] // 2 // block
            row = torch.arange(rows.shape[0])
            index = (shifts[row // K] + (row % K) * block).unsqueeze(1) + torch.arange(block)
            r = (rows.double() * p.double().unsqueeze(1)) * inverse.double().unsqueeze(1)  # not rounded
            total = (r + table[index].double()).float()
            values.copy_(total.floor().clamp(-127, 127).to(torch.int8).view(-1)[: x.shape[0]])
            return scale, p, inverse

        return kernel

    return {"quantize_nearest": nearest, "quantize_stochastic": stochastic}


def test_enable_refuses_kernels_that_round_one_unit_otherwise(traced, monkeypatch):
    """The H200's fault was 6 values of 16,777,216 one apart: a division rounded otherwise. Planted here: an
    inverse one unit off in 1 block of 9,973 (14 blocks of the sample's 131,077: a fraction 10^-4), and products
    that reach the stochastic sum unrounded. Both kernels must fail enable's check and stay eager, the line
    naming how many bytes differ."""
    monkeypatch.setattr(fused, "_FUNCTIONS", {**fused._FUNCTIONS, **one_unit_off(9973, 7)})
    monkeypatch.setattr(fused, "_compiled", {})
    lines = traced(kernels=("quantize_nearest", "quantize_stochastic"))
    assert fused.enabled() == [], lines
    for name in ("quantize_nearest", "quantize_stochastic"):
        failed = fused.choices()[(name, "cpu", B)]["failed"]
        assert "differs from the eager reference in" in failed, failed
        assert f"{name} eager (fused failed:" in lines[-1], lines


@pytest.mark.quick
def test_enable_switches_on_the_faster_of_fused_and_eager(traced, monkeypatch):
    """Issue 52: on the H200 the fused 16-bit encode took 19.8x a copy, eager 4.2x. ``enable`` times both on its
    sample and keeps the faster, saying both in its line; here the timings are given
    (``cerar.formats.devices.side_by_side_seconds``): eager twice as fast leaves the kernel off, fused twice as fast
    switches it on. The bytes were checked first either way."""
    timings = {"copy": 1.0, "fused": 4.0, "eager": 2.0}
    monkeypatch.setattr(devices, "side_by_side_seconds", lambda calls, device, repeats: {k: timings[k] for k in calls})
    lines = traced(kernels=("wire_encode", "quantize_nearest"), pick="faster", sample_values=2 * fused.MIN_VALUES)
    assert fused.enabled() == [], lines
    assert "wire_encode eager 2.00 (fused 4.00;" in lines[-1] and "quantize_nearest eager 2.00" in lines[-1], lines
    assert fused.checked_kernel("wire_encode", "cpu") is not None  # passed its check: benchmarks may still time it
    fused.disable()
    timings.update(fused=1.0)
    lines = traced(kernels=("wire_encode",), pick="faster", sample_values=2 * fused.MIN_VALUES)
    assert fused.enabled() == [("wire_encode", "cpu", 0)], lines
    assert "wire_encode fused 1.00 (eager 2.00;" in lines[-1]
    assert fused.choices()[("wire_encode", "cpu", 0)] == {"fused": 1.0, "eager": 2.0, "copy_s": 1.0, "chosen": "fused"}


@pytest.mark.quick
def test_enable_refuses_bad_arguments_and_respects_cerar_fused_0(monkeypatch):
    with pytest.raises(ValueError, match="unknown kernels"):
        fused.enable("cpu", 128, kernels=("quantize_sideways",))
    with pytest.raises(ValueError, match="pick must be 'faster' or 'fused'"):
        fused.enable("cpu", 128, pick="fastest")
    with pytest.raises(ValueError, match="sample_values must be an integer >= 32768"):
        fused.enable("cpu", 128, sample_values=1000)
    monkeypatch.setenv("CERAR_FUSED", "0")
    lines = []
    assert fused.enable("cpu", 128, say=lines.append) == {}
    assert lines == ["cerar.formats.fused: the eager arithmetic is used (CERAR_FUSED=0)"] and fused.enabled() == []


@pytest.mark.quick
def test_the_format_benchmark_runs_every_row_on_this_cpu(monkeypatch):
    """scripts/bench/format_timing.py (what a GPU benchmark calls, ``formats_against_copy``), a dry run: every
    format's row against a copy, eager, fused and chosen, each fused and chosen row with the eager bytes."""
    from scripts.bench.format_timing import formats_against_copy

    monkeypatch.delenv("CERAR_FUSED", raising=False)
    try:
        result = formats_against_copy("cpu", mib=(0.125,), reps=1, backend="eager", sample_values=2 * fused.MIN_VALUES,
                                      say=lambda line: None)  # fmt: skip
    finally:
        fused.disable()
    rows = result["rows"]
    operations = {r["operation"] for r in rows}
    assert operations == {"copy", "int8 quantize, nearest", "int8 quantize, stochastic", "int8 dequantize",
                          "int8 dequantize and add", "wire float16 encode", "wire float16 decode",
                          "wire bfloat16 encode", "wire bfloat16 decode", "int4 quantize, nearest, rotated",
                          "int4 quantize, stochastic, rotated", "int4 dequantize, rotated",
                          "int4 dequantize and add, rotated"}  # fmt: skip
    fused_rows = [r for r in rows if r["variant"] == "fused"]
    assert len(fused_rows) == 4 and all(r["same_bytes"] for r in rows), rows
    assert all(r["x_copy"] > 0 for r in rows) and set(result["choices"]) == {
        "quantize_nearest/cpu/128", "quantize_stochastic/cpu/128", "wire_encode/cpu/0"}  # fmt: skip


@pytest.mark.quick
def test_the_device_forms_write_the_cpu_forms_bytes(monkeypatch):
    """The eager arithmetic a GPU runs (cerar.formats.devices.one_pass: the decode's int8 x float32 product and the
    16-bit encode's product written straight into their outputs, one pass each; the encode's absmax by aminmax),
    forced on this CPU, against the CPU's forms: the same float32 and 16-bit bytes, non-finite values and a
    block of zeros included. The 16-bit decode takes 2^-k as a one-value float32 tensor: a 0-d one would leave
    the product in 16 bits."""
    s = 2**15 + 3 * B + 5
    x = adversarial(B, s, seed=9)
    message = q8.new_message(s, B, "cpu")
    q8.quantize_eager(message, x, B, "stochastic", 5)
    start = torch.linspace(-1, 1, s)

    def run() -> dict:
        out = {}
        for add in (False, True):
            y = start.clone()
            q8.dequantize(message, s, B, y, add=add)
            out[f"dequantize add={add}"] = y
        for dtype in ("float16", "bfloat16"):
            wire = Wire(dtype)
            for name, block in (("finite", x.nan_to_num(0.0, 0.0, 0.0) * 1e-3), ("non-finite", x)):
                msg = wire.empty(s, block)
                wire.encode_eager(block, msg)
                y = torch.empty(s)
                wire.decode(msg, y)
                out[f"{dtype} {name}"] = (msg.view(torch.int16), y)
        return out

    cpu = run()
    monkeypatch.setattr(devices, "one_pass", lambda device: True)
    device = run()
    for key, value in cpu.items():
        got = device[key]
        for a, b in zip(value, got, strict=True) if isinstance(value, tuple) else [(value, got)]:
            same = a.view(torch.int32) if a.dtype == torch.float32 else a
            other = b.view(torch.int32) if b.dtype == torch.float32 else b
            nan = torch.isnan(a) if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
            assert torch.equal(same[~nan], other[~nan]) and torch.isnan(b[nan]).all(), key
