"""The planning tools: what to run, before running it.

``design``: the code for N workers and c components within an error and kappa budget (``python -m
cerar.planning.design``); ``costmodel``: every aggregator's time per call from the bytes it sends, the links'
latency and bandwidth and the arithmetic's memory traffic (torch-free: it imports nothing of the library);
``link_probe``: the links measured on a running group, fitted to the cost model's alpha and beta.
This package imports nothing at import time, so that ``costmodel`` stays importable without torch.
"""
