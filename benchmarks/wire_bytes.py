"""Bytes on the wire per selected element, per model and wire format.

Builds the layer-wise layout dlgs sends for each model (``plan_layers`` with the
library's defaults, one message per sparse layer as ``merge="none"`` does) and
sums the real :class:`~dlgs.core.wire.GroupLayout` chunk sizes: values, indices,
count words, block counts and fingerprints, divided by the selected elements
(the capacities). Exact arithmetic on the layouts, no timing: it runs anywhere
in seconds. Models: the benchmarks' torch models (parameter shapes) and the
planner's catalog structures.

Example::

    python -m benchmarks.wire_bytes --out benchmarks/results/wire-bytes
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from dlgs.catalog import MODELS as CATALOG
from dlgs.catalog import catalog_model
from dlgs.core import GroupLayout, SparsityConfig, plan_layers

from .report import write_csv

__all__ = ["FORMATS", "main", "model_sizes", "wire_row"]

#: (label, index_coding, value_dtype); the first is the original format (int32
#: indices, float32 values), before the compact index codings.
FORMATS: Tuple[Tuple[str, str, str], ...] = (
    ("int32 + float32 (before)", "int32", "float32"),
    ("auto + float32", "auto", "float32"),
    ("auto + float16", "auto", "float16"),
    ("auto + bfloat16", "auto", "bfloat16"),
)


def model_sizes(name: str) -> List[int]:
    """Parameter sizes of a benchmark model (``fashion``, ``resnet20``,
    ``vgg16``, ``lstm``, ``bert-small``) or a ``catalog:NAME`` structure."""
    if name.startswith("catalog:"):
        return [layer.numel for layer in catalog_model(name[8:]).layers]
    from . import models

    builders = {
        "fashion": lambda: models.FashionCNN(),
        "resnet20": lambda: models.ResNet20(),
        "vgg16": lambda: models.VGG16(),
        "lstm": lambda: models.LSTMLM(vocab=10000),
        "bert-small": lambda: models.BertSmall(),
    }
    if name not in builders:
        raise ValueError(f"model must be one of {sorted(builders)} or catalog:NAME, got {name!r}")
    return [p.numel() for p in builders[name]().parameters()]


def wire_row(sizes: Sequence[int], density: float, coding: str, value_dtype: str) -> Dict:
    """The sparse layers' bytes and selected elements in one step of one rank."""
    cfg = SparsityConfig(density=density, index_coding=coding, value_dtype=value_dtype)
    plans = [p for p in plan_layers(sizes, density, cfg) if p.sparse]
    chunks = [GroupLayout((p.numel,), (p.capacity,), value_dtype, coding) for p in plans]
    sent = sum(lay.chunk_bytes for lay in chunks)
    selected = sum(p.capacity for p in plans)
    return dict(
        sparse_layers=len(plans),
        block16_layers=sum(lay.block16 for lay in chunks),
        bitmap_layers=sum(lay.bitmap for lay in chunks),
        selected=selected,
        bytes=sent,
        bytes_per_element=sent / selected if selected else float("nan"),
    )


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        default="fashion,resnet20,vgg16,lstm,bert-small,"
        + ",".join(f"catalog:{m}" for m in CATALOG),
    )
    parser.add_argument("--densities", default="0.1,0.01,0.001")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/wire-bytes"))
    args = parser.parse_args(argv)
    rows = []
    for model in args.models.split(","):
        sizes = model_sizes(model)
        for density in (float(d) for d in args.densities.split(",")):
            for label, coding, dtype in FORMATS:
                row = dict(model=model, params=sum(sizes), density=density, format=label)
                rows.append({**row, **wire_row(sizes, density, coding, dtype)})
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "wire_bytes.csv", append=False)
    command = "python -m benchmarks.wire_bytes " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    labels = [label for label, _, _ in FORMATS]
    lines = [
        "# Bytes on the wire per selected element",
        "",
        f"Command: `{command}`",
        "",
        "Sum of the real layouts' chunk bytes (values, indices, count words, block counts,",
        "fingerprints) of one rank's sparse layers, sent layer by layer, over their selected",
        "elements; library defaults otherwise (`min_sparse_size=1024`, `max_ratio=1`).",
        "`auto` takes per message the smallest of int32 indices, block16 (2 bytes each plus",
        "a count per 65,536 elements) and a bitmap (a bit per element and per slot).",
        "",
        "| model | parameters | density | sparse layers | " + " | ".join(labels) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(labels),
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        for density in dict.fromkeys(r["density"] for r in rows):
            cells = [r for r in rows if r["model"] == model and r["density"] == density]
            by = {r["format"]: r for r in cells}
            lines.append(
                f"| {model} | {cells[0]['params'] / 1e6:.2f} M | {density:g} | "
                f"{by[labels[1]]['sparse_layers']} | "
                + " | ".join(f"{by[label]['bytes_per_element']:.2f}" for label in labels)
                + " |"
            )
    text = "\n".join(lines) + "\n"
    (args.out / "wire_bytes.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
