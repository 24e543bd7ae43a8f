"""The torch half of the training benchmark (``python -m benchmarks.train``).

Builds each method's optimizer, times full iterations on this rank and hands
the times to :func:`benchmarks.report.write_outputs`; the methods, timing
definitions and outputs are described in ``benchmarks/train.py``.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import horovod
import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

import dlgs.torch
from dlgs.catalog import DEFAULT_COMPUTE_FLOPS

from . import ddp_methods
from .emulate import EmulatedNet, Emulation, emulation_from, measure_layers
from .models import LSTMLM, VGG16, BertSmall, ResNet20
from .report import (
    DDP_METHODS,
    LR,
    TWO_LEVEL_METHODS,
    MethodTimes,
    base_method,
    guard_verdict,
    is_auto,
    predicted_tails,
    run_rounds,
    settle_steps,
    setup_rank_logging,
    sparse_options,
    wire_options,
    write_outputs,
)

__all__ = ["MODELS", "TIMING", "ModelSpec", "build_optimizer", "run", "run_method"]

logger = logging.getLogger("benchmarks.train")

Batch = Tuple[torch.Tensor, torch.Tensor]

#: What the Markdown says the columns measure.
TIMING = (
    "Step times in ms: a full iteration (zero_grad, forward, backward, step), median "
    "[p10–p90] over the timed steps, of the slowest rank (largest median). Backward "
    "(the `backward()` call, which starts the exchange) and step wait (inside "
    "`opt.step()`: waiting for communication, unpacking, the update) are that rank's "
    "medians. Sparsify: for the methods built on dlgs, that rank's median host time in "
    "its gradient hooks (selection, packing, starting collectives), part of backward. "
    "Wire: bytes one rank contributes per step (dense/fp16: 4/2 bytes per parameter; "
    "dlgs: `.dlgs.exchange.wire_bytes()`, every message at capacity with its header, dense "
    "layers at 4 bytes; with `--rounds`, the mean over rounds, as each round plans "
    "anew). Efficiency: no-comm median / method median. Predicted: the no-comm median "
    "plus what dlgs's planner predicts the method's communication adds beyond "
    "back-propagation, from the profile the `dlgs` method measured (its plan in force; "
    "layer-wise or bucketed plans for the others; dense and fp16 as layer-wise allreduces, "
    "Horovod's tensor fusion not modelled), and its error against the measured median."
)


@dataclass(frozen=True)
class ModelSpec:
    """How to build, feed and score one benchmark model.

    Attributes:
        build: a fresh model (seed the global RNG first for equal weights).
        batch: default per-rank batch size.
        make_batch: ``(batch, generator) -> (inputs, targets)``, synthetic.
        loss: ``(outputs, targets) -> scalar``.
        sample: what one sample is, for the report.
    """

    build: Callable[[], nn.Module]
    batch: int
    make_batch: Callable[[int, torch.Generator], Batch]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    sample: str


def _images(batch: int, g: torch.Generator) -> Batch:
    return torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _ptb_tokens(batch: int, g: torch.Generator) -> Batch:
    # 35-token BPTT windows; the target is the next token.
    seq = torch.randint(0, 10000, (batch, 36), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _mlm_tokens(batch: int, g: torch.Generator) -> Batch:
    # BERT-style masked LM: 15% of positions replaced by id 0 ([MASK]) and
    # predicted; the rest are ignored by the loss.
    tokens = torch.randint(1, 8000, (batch, 128), generator=g)
    masked = torch.rand(batch, 128, generator=g) < 0.15
    return tokens.masked_fill(masked, 0), tokens.masked_fill(~masked, -100)


def _sequence_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1), ignore_index=-100)


MODELS: Dict[str, ModelSpec] = {
    "resnet20": ModelSpec(ResNet20, 32, _images, F.cross_entropy, "32x32 image"),
    "vgg16": ModelSpec(VGG16, 32, _images, F.cross_entropy, "32x32 image"),
    "lstm": ModelSpec(LSTMLM, 20, _ptb_tokens, _sequence_loss, "35-token sequence"),
    "bert-small": ModelSpec(BertSmall, 16, _mlm_tokens, _sequence_loss, "128-token sequence"),
}


def build_optimizer(
    method: str,
    model: nn.Module,
    density: float,
    profile_steps: int,
    wire: Optional[Dict[str, str]] = None,
) -> torch.optim.Optimizer:
    """The optimizer ``method`` trains with (plain SGD, lr 0.01, inside)."""
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0)
    if method == "no-comm":
        return sgd
    if method in ("dense", "fp16"):
        compression = hvd.Compression.fp16 if method == "fp16" else hvd.Compression.none
        return hvd.DistributedOptimizer(
            sgd, named_parameters=model.named_parameters(), compression=compression
        )
    return dlgs.torch.DistributedOptimizer(
        sgd,
        named_parameters=model.named_parameters(),
        **sparse_options(method, density),
        profile_steps=profile_steps,
        **(wire or {}),
    )


def run_method(
    spec: ModelSpec,
    method: str,
    data: Batch,
    *,
    density: float,
    warmup: int,
    steps: int,
    profile_steps: int,
    progress: Optional[Any] = None,
    wire: Optional[Dict[str, str]] = None,
    bucket_mb: Optional[float] = None,
) -> MethodTimes:
    """Warm up, then time ``steps`` full iterations of ``method`` on this rank.

    The model is built from seed 0 and broadcast from rank 0, so every method
    starts from the same weights. For merging dlgs methods the warm-up covers
    the profile and the first planned step; a plan not in force by then is an
    error (the timed steps would measure the profiler).
    """
    torch.manual_seed(0)
    model = spec.build()
    if not isinstance(model, EmulatedNet):  # its parameters start as zeros on every rank
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    module = model  # DDP methods: the model inside DDP
    if method in DDP_METHODS:
        model, opt, state = ddp_methods.build_ddp(
            method, model, density, profile_steps, LR, wire, bucket_mb
        )
        dlgs_of = state.dlgs if isinstance(state, dlgs.torch.ddp.SparseState) else None
    else:
        opt = build_optimizer(method, model, density, profile_steps, wire)
        dlgs_of = getattr(opt, "dlgs", None)
    x, y = data
    sparse = dlgs_of is not None
    out = MethodTimes(method)
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = spec.loss(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i >= warmup:
            out.iteration.append(t3 - t0)
            out.backward.append(t2 - t1)
            out.step_wait.append(t3 - t2)
            if sparse:
                out.sparsify.append(dlgs_of.exchange.last_step.submit_seconds)
        elif i == warmup - 1 and sparse and dlgs_of.planner.strategy != "none":
            if not dlgs_of.planner.settled:
                raise RuntimeError(
                    f"{method}: no final merge plan after {warmup} warm-up steps "
                    f"(expected one after {settle_steps(profile_steps, is_auto(method))})"
                )
        if progress is not None:
            progress.update(1)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if sparse:
        out.wire_bytes = dlgs_of.exchange.wire_bytes()
        out.density = dlgs_of.exchange.density
        out.messages = len(dlgs_of.exchange.groups)
        out.guard = guard_verdict(dlgs_of.planner)
        if base_method(method) == "dlgs":
            out.predicted_tails = predicted_tails(dlgs_of.planner, dlgs_of.exchange)
        if dlgs_of.planner.plan is not None:
            logger.debug("%s: plan in force\n%s", method, dlgs_of.planner.plan.describe())
    elif method in DDP_METHODS:
        out.wire_bytes = ddp_methods.wire_bytes(method, module)
    elif method == "dense":
        out.wire_bytes = 4 * params
    elif method == "fp16":
        out.wire_bytes = 2 * params
    return out


def run(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """Run the benchmark on this rank (under horovodrun on every rank);
    ``args`` from :func:`benchmarks.report.parse_args`, ``argv`` for the record."""
    # The two-level methods add process sets (every method then runs with them).
    two_level = any(base_method(m) in TWO_LEVEL_METHODS for m in args.methods)
    hvd.init(process_sets="dynamic" if two_level else None)
    rank = hvd.rank()
    if any(m in DDP_METHODS for m in args.methods):
        ddp_methods.init_torch_distributed(
            rank,
            hvd.size(),
            lambda obj: hvd.broadcast_object(obj, root_rank=0, name="benchmarks.train.port"),
        )
    setup_rank_logging(rank, args.verbose)
    threads = int(os.environ.get("DLGS_THREADS", "1"))
    torch.set_num_threads(threads)
    spec = MODELS[args.model]
    batch = args.batch or spec.batch
    data = spec.make_batch(batch, torch.Generator().manual_seed(1000 + rank))
    emulation = None
    if args.emulate is not None:
        emulation = _emulation(args, spec, batch, data, rank)
        spec, batch, data = _emulated_spec(emulation, rank)
    load_start = os.getloadavg()[0]

    def one(method: str, round_: int, warmup: int, bar: Any) -> MethodTimes:
        return run_method(
            spec,
            method,
            data,
            density=args.density,
            warmup=warmup,
            steps=args.steps,
            profile_steps=args.profile_steps,
            progress=bar,
            wire=wire_options(args),
            bucket_mb=args.bucket_cap_mb,
        )

    mine = run_rounds(args, rank, hvd.barrier, one)
    # Plain dicts: a dataclass would pickle by its module path.
    gathered = hvd.allgather_object([vars(t) for t in mine.values()], name="benchmarks.train.times")
    ddp_methods.close_torch_distributed()
    if rank != 0:
        return
    section = write_outputs(
        gathered,
        args,
        argv,
        batch=batch,
        workers=hvd.size(),
        versions=f"torch {torch.__version__}, Horovod {horovod.__version__}",
        threads=f"{threads} torch thread(s) per rank",
        sample=spec.sample,
        timing=TIMING,
        load_start=load_start,
        model=emulation.name if emulation is not None else None,
        compute=emulation.label if emulation is not None else "real",
    )
    print(section)


def _emulation(
    args: argparse.Namespace, spec: ModelSpec, batch: int, data: Batch, rank: int
) -> Emulation:
    """Rank 0's :class:`Emulation` for ``--emulate``, the same on every rank
    (a measured profile is measured once, on rank 0, and broadcast)."""
    emulation = None
    if rank == 0:

        def measure() -> Tuple[str, int, Any]:
            torch.manual_seed(0)
            return args.model, batch, measure_layers(spec.build(), data, spec.loss)

        emulation = emulation_from(
            args.emulate,
            speed=args.emulate_speed or 1.0,
            batch=args.batch,
            flops=args.emulate_flops or DEFAULT_COMPUTE_FLOPS,
            measure=measure,
        ).to_dict()
    emulation = hvd.broadcast_object(emulation, root_rank=0, name="benchmarks.train.emulation")
    out = Emulation.from_dict(emulation)
    if rank == 0:
        logger.info(
            "%s: %d tensors, %.1f M parameters, %s",
            out.name,
            len(out.layers),
            sum(x.numel for x in out.layers) / 1e6,
            out.label,
        )
    return out


def _emulated_spec(emulation: Emulation, rank: int) -> Tuple[ModelSpec, int, Batch]:
    """The :class:`ModelSpec`, batch and input of an emulated model. Its
    gradient draws are made once per process and shared by every method's net."""
    first = EmulatedNet(emulation, rank)
    draws = first.draws

    def build() -> nn.Module:
        return EmulatedNet(emulation, rank, draws=draws)

    spec = ModelSpec(
        build, emulation.batch, lambda b, g: _NO_DATA, lambda out, y: out, "emulated sample"
    )
    return spec, emulation.batch, _NO_DATA


_NO_DATA: Batch = (torch.zeros(()), torch.zeros(()))
