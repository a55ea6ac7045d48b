"""The GPU benchmark: what the trainer, CERAR's arithmetic and the formats cost on one GPU, in one command
that fits a lent machine's minutes (``python -m scripts.bench.gpu``, or ``python -m scripts.checks.gpu --bench``).

Writes ``reports/gpu_bench.md`` and ``reports/data/gpu_bench.jsonl`` (one JSON object per row), row by row as
each is measured, so that a run cut short by its lease still says what it measured and where it stopped.

Sections, in the order they run (``runner.STAGES``):

- ``arithmetic``: one rank's CERAR rounds with the transfers replaced by local copies
  (``scripts.checks.gpu.throughput.one_rank_arithmetic``): kernels per call and the GPU's busy time under
  ``torch.profiler``, the call's time, and that time as a multiple of a device copy of the gradient;
- ``formats``: the 8-bit block format's quantize and dequantize and the 16-bit wire's encode and decode
  (``cerar.formats``), eager and after ``cerar.formats.fused.enable``, each as a multiple of a copy;
- ``trainer``: ``train/main.py`` at world size 1 per model size, compiled and eager (``trainer.compile``),
  its own ``mfu`` and ``time/*`` phases from its metrics.jsonl, the first steps dropped as warm-up;
- ``model_step``: the plain training step of ``diag.py`` (``train.model.build_model``, bf16 autocast,
  ``AdamW(fused=True)``, random tokens), eager and under ``torch.compile``: what the trainer's loop adds.

Times are medians of timed repeats after warm-up, with CUDA events on a GPU (``measure.timed``); on the CPU
(the dry run, ``--device cpu --small``) the wall clock, at toy sizes, to run the machinery, not to measure.
Every row carries what it measured, its seed, the tree's commit, the device and the torch, CUDA, NCCL and
Triton versions (``measure.provenance``)."""
