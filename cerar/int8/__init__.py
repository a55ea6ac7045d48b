"""The 8-bit all-reduce: values in 8 bits with one float32 scale per block, every rank the same result.

``all_reduce``: the flat collective (reduce-scatter of 8-bit shards, sums in float32, all-gather of the
re-quantized sums); ``two_tier``: exact inside each node, 8-bit between the nodes on the rails of
``cerar.hierarchical``; ``hook``: both as DDP communication hooks. The format is ``cerar.formats.int8_blocks``;
docs/int8.md gives its error bound and bytes.
"""
