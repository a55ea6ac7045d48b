"""The 4-bit all-reduce: values in 4 bits, two to a byte, one float32 scale per block, every rank the same result.

``codecs``: the block formats as the two shots see them (4-bit, and 8-bit for inside a node); ``two_shot``: the
reduce-scatter of once-rounded shards and the all-gather of the once-rounded sums, for any format; ``all_reduce``:
the flat 4-bit call; ``two_tier``: exact or 8-bit inside each node, 4 bits on the rails between the nodes;
``hook``: both as DDP communication hooks. The format is ``cerar.formats.int4_blocks``; docs/int4.md gives its error
bound and bytes.
"""
