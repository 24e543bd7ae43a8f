"""Where the two-level reduction's bytes between nodes grow (docs/benchmarks.md,
issue 44): per rank and direction, ResNet-50's sparse layers (shards of 2 ranks
per node, density 0.01, float16 values, reduce_width 1.25), 2 (N - 1) blocks of
each message crossing a rank's link, split into payload, offset tables and count
words with dlgs.core.transport.blocks. Run from the project root:

    python benchmarks/results/2026-12-06-hier-reduce-bytes/arithmetic/decompose.py
"""

from dlgs.catalog import catalog_model
from dlgs.core.config import IndexCoding, SparsityConfig, ValueDType
from dlgs.core.transport.blocks import block_words, compact_offsets
from dlgs.core.transport.hierarchical import shard_size
from dlgs.core.transport.reduction import block_width
from dlgs.core.wire import plan_layers

config = SparsityConfig(density=0.01, value_dtype="float16", reduce_width=1.25)
shards = [shard_size(layer.numel, 2) for layer in catalog_model("resnet50").layers]
plans = plan_layers(shards, config.density, config)
print("| nodes | total | payload (offsets and values) | offset tables | count words |")
print("|---:|---:|---:|---:|---:|")
for nodes in (4, 8, 16, 64):
    total = tables = counts = 0
    for m, plan in zip(shards, plans):
        if not plan.sparse:
            continue
        width = block_width(config.reduce_width, plan.capacity, nodes)
        words = block_words(width, m, ValueDType.FLOAT16, IndexCoding.AUTO)
        hi = m // 65536 if compact_offsets(width, m, IndexCoding.AUTO) else 0
        blocks = 2 * (nodes - 1)
        total += blocks * words * 4
        tables += blocks * hi * 4
        counts += blocks * 4
    payload = total - tables - counts
    print(
        f"| {nodes} | {total / 1e6:.3f} MB | {payload / 1e6:.3f} MB | "
        f"{tables / 1e3:.1f} KB | {counts / 1e3:.1f} KB |"
    )
