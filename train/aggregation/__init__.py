"""How the trainer sums gradients across replicas: the aggregators, their builder and the two automatic choices.

``aggregators``: one class per ``aggregator.kind`` (exact all-reduce, 16-bit casts, PowerSGD, CERAR, the exact
ring, the two tiers, the 8-bit all-reduce) behind one interface (``aggregate``, ``step_metrics``, the DDP hook);
``build``: the one the config names (``build_aggregator``) and the fused kernels it calls; ``auto_c``: ``c=auto``,
CERAR's c chosen from the run's own gradients; ``auto_choice`` and ``auto_aggregator``: ``aggregator=auto``, the
fastest candidate on the measured links whose error fits the budget; ``tensor_errors``: the error of an
aggregate judged per parameter tensor, against that tensor's noise, as Adam sees it (what both autos decide on).
"""
