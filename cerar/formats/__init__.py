"""The message formats: how a block of float32 values travels in fewer bits, and back.

``wire``: 16-bit messages (float16 or bfloat16, each with a power-of-two scale), the transport CERAR and the exact
rings may use; ``int8_blocks``: the 8-bit format (one float32 scale per block of values, rounded to nearest or
stochastically) of the 8-bit all-reduce; ``fused``: their encode and quantize fused into one loop by
``torch.compile`` (switched on by a caller before its first collective; the eager functions stay the reference).
Nothing here communicates.
"""
