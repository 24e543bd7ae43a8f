"""Emulated accelerator compute for the training benchmark (torch).

On GPU nodes a model's forward and backward passes run on the accelerator and
leave the host's cores to communication; on this 2-core machine real compute
on 4 or more ranks measures CPU contention, not the network. An
:class:`EmulatedNet` keeps everything dlgs and Horovod do for real -- one
parameter tensor per layer of the emulated model, gradient hooks firing in
back-propagation order, selection, packing, merge plan, collectives over the
rate-limited cluster -- and replaces each layer's computation by a *wait* (a
sleep, not a busy loop) of the layer's duration.

**The device model.** Each pass runs its layers back to back on an emulated
device clock that starts when the pass starts: layer ``i``'s gradient is
ready ``backward[0] + ... + backward[i]`` seconds into back-propagation,
whatever the host did meanwhile. That is how a GPU behaves while the host
keeps ahead of it (the host queues kernels, dlgs's hooks queue their own
behind them); the host time of dlgs's hooks is spent here on a CPU that
selects ~100x slower than an accelerator's memory, and it delays the step
only where it exceeds the compute left to hide it (the benchmark's
``sparsify`` column shows it). The forward pass takes half the backward
pass (back-propagation costs about two forward passes).

**Durations** come from a per-layer profile (gradient-ready order):

* ``catalog:MODEL``: dlgs's built-in structures (``resnet50``, ``vgg16``,
  ``bert-base``, ``ptb-lstm``) with their compute model at ``--emulate-flops``
  FLOP/s per worker (:func:`dlgs.catalog.catalog_profile`);
* ``measured``: the benchmark's ``--model`` measured on this machine (rank 0,
  a few steps without communication, one torch thread);
* a path to a saved dlgs :class:`~dlgs.core.planning.profile.Profile` JSON (e.g. one
  measured on a GPU with ``planner.profile.to_dict()``), replayed as it is;

each divided by ``--emulate-speed`` (a device that many times faster).

**Gradient values** are drawn once per rank (seeded by rank and layer) from a
Student-t distribution whose degrees of freedom :func:`fit_tail` fitted to the
real gradients of this project's four benchmark models (``python -m
benchmarks.emulate``; docs/benchmarks.md has the fit): what the dynamic
controller learns is the ratio of the selection threshold to the mean
magnitude, and the fit matches that ratio at density 0.01. A catalog
structure takes its family's fit (:data:`FAMILY`: ResNet-50 ResNet-20's, close
to normal; BERT-base BERT-small's, heavy-tailed), a replayed profile the fit
over all four. Each layer keeps
two draws and alternates them step by step, so residuals, thresholds and
selected positions move from step to step as with real gradients. Values are
scaled by ``1 / sqrt(numel)`` (the controllers are scale-free).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from dlgs.catalog import DEFAULT_COMPUTE_FLOPS, catalog_model, catalog_profile
from dlgs.catalog import MODELS as CATALOG
from dlgs.core.planning.profile import LayerProfile, Profile

__all__ = [
    "STUDENT_T_DF",
    "Emulation",
    "EmulatedNet",
    "emulation_from",
    "fit_tail",
    "measure_layers",
]

logger = logging.getLogger("benchmarks.emulate")

#: Degrees of freedom of the gradient values' Student-t distribution, fitted
#: to each benchmark model's real gradients by :func:`fit_tail` (``python -m
#: benchmarks.emulate``): the convolutional nets' are close to normal, the
#: LSTM's and BERT's heavy-tailed.
FITTED_DF: Dict[str, int] = {"resnet20": 30, "vgg16": 12, "lstm": 2, "bert-small": 2}
#: The fit over all four models' tensors together: for a replayed profile.
STUDENT_T_DF = 4
#: The benchmark model whose fit stands for each catalog structure.
FAMILY: Dict[str, str] = {
    "resnet50": "resnet20",
    "vgg16": "vgg16",
    "bert-base": "bert-small",
    "ptb-lstm": "lstm",
}

#: Distinct gradient draws per layer, used in turn.
DRAWS = 2


@dataclass(frozen=True)
class Emulation:
    """What an :class:`EmulatedNet` emulates.

    Attributes:
        name: the model, for reports (``resnet50``, ``resnet20``, a profile's file name).
        source: where the durations came from, for reports.
        layers: the parameter tensors in gradient-ready order, with their
            emulated backward seconds (already divided by ``speed``).
        batch: samples per worker the durations are for.
        speed: the factor the source's durations were divided by.
        df: the gradient values' Student-t degrees of freedom.
    """

    name: str
    source: str
    layers: Tuple[LayerProfile, ...]
    batch: int
    speed: float
    df: int = STUDENT_T_DF

    @property
    def backward(self) -> float:
        """Emulated seconds of one backward pass."""
        return sum(layer.backward for layer in self.layers)

    @property
    def forward(self) -> float:
        """Emulated seconds of one forward pass: half the backward pass."""
        return self.backward / 2

    @property
    def label(self) -> str:
        """One line for CSV, Markdown and plots."""
        speed = "" if self.speed == 1 else f" / {self.speed:g}"
        return (
            f"emulated compute: {self.source}{speed}, "
            f"{1e3 * (self.forward + self.backward):.1f} ms, Student-t df {self.df}"
        )

    def to_dict(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "batch": self.batch,
            "speed": self.speed,
            "df": self.df,
            "layers": [[x.name, x.numel, x.backward] for x in self.layers],
        }

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Emulation":
        layers = tuple(LayerProfile(str(n), int(k), float(b)) for n, k, b in d["layers"])
        return cls(d["name"], d["source"], layers, int(d["batch"]), float(d["speed"]), int(d["df"]))


def emulation_from(
    source: str,
    *,
    speed: float = 1.0,
    batch: Optional[int] = None,
    flops: float = DEFAULT_COMPUTE_FLOPS,
    measure: Optional[Callable[[], Tuple[str, int, Sequence[LayerProfile]]]] = None,
) -> Emulation:
    """The :class:`Emulation` that ``--emulate SOURCE`` names.

    Args:
        source: ``catalog:MODEL``, ``measured`` or a Profile JSON path.
        speed: divide every duration by this (> 0).
        batch: samples per worker for ``catalog:`` (default: the model's).
        flops: FLOP/s per worker for ``catalog:`` (> 0).
        measure: for ``measured``: returns ``(model name, batch, layers)``.

    Raises:
        ValueError: an unknown source or an out-of-range number (the message
            names the option).
    """
    if not (isinstance(speed, (int, float)) and 0 < speed < math.inf):
        raise ValueError(f"--emulate-speed must be a finite number > 0, got {speed!r}")
    if source.startswith("catalog:"):
        model = source.split(":", 1)[1]
        if model not in CATALOG:
            raise ValueError(
                f"--emulate catalog:MODEL: unknown model {model!r}; choose from "
                f"{', '.join(sorted(CATALOG))}"
            )
        prof = catalog_profile(
            model, world_size=1, bandwidth_bps=1e9, batch=batch, compute_flops=flops * speed
        )
        used = batch if batch is not None else catalog_model(model).batch
        return Emulation(
            model,
            f"{source} at {flops / 1e12:g} TFLOP/s",
            prof.layers,
            used,
            float(speed),
            FITTED_DF[FAMILY[model]],
        )
    if source == "measured":
        if measure is None:
            raise ValueError("--emulate measured needs a model to measure (--model)")
        name, used, layers = measure()
        return Emulation(
            name,
            f"{name} measured on this machine",
            tuple(LayerProfile(x.name, x.numel, x.backward / speed) for x in layers),
            used,
            float(speed),
            FITTED_DF.get(name, STUDENT_T_DF),
        )
    path = Path(source)
    if not path.is_file():
        raise ValueError(
            f"--emulate must be catalog:MODEL, 'measured' or a saved Profile JSON file, "
            f"got {source!r} (no such file)"
        )
    prof = Profile.from_dict(json.loads(path.read_text()))
    return Emulation(
        path.stem,
        f"profile {path.name}",
        tuple(LayerProfile(x.name, x.numel, x.backward / speed) for x in prof.layers),
        batch or 1,
        float(speed),
    )


class _Clock:
    """The emulated device's clock for one pass: each wait ends ``seconds``
    after the previous one was due, or now if the host fell behind."""

    def __init__(self) -> None:
        self.due: Optional[float] = None

    def start(self) -> None:
        self.due = time.perf_counter()

    def wait(self, seconds: float) -> None:
        if self.due is None:
            self.start()
        assert self.due is not None
        self.due += seconds
        left = self.due - time.perf_counter()
        if left > 0:
            time.sleep(left)


class _Layer(torch.autograd.Function):
    """One emulated layer: waits out its forward / backward time and hands
    its parameter the gradient the net drew for this step."""

    @staticmethod
    def forward(ctx, h, param, net, i):  # type: ignore[override]
        ctx.net, ctx.i = net, i
        net.clock.wait(net.forward_seconds[i])
        return h.clone()

    @staticmethod
    def backward(ctx, grad_h):  # type: ignore[override]
        net, i = ctx.net, ctx.i
        if i == len(net.forward_seconds) - 1:
            net.clock.start()  # the first layer of back-propagation
        net.clock.wait(net.backward_seconds[i])
        return grad_h, net.gradient(i), None, None


class EmulatedNet(nn.Module):
    """A module with the emulated model's parameter tensors (1-D, float32, in
    forward order) whose passes wait instead of computing.

    ``net(x)`` for any 0-d ``x`` returns a 0-d "loss"; ``loss.backward()``
    runs the layers' backward waits in reverse and hands each parameter a
    drawn gradient (see the module docstring), so Horovod's and dlgs's hooks
    fire in back-propagation order at the emulated times.

    Args:
        emulation: the layers and durations.
        rank: seeds the gradient draws (ranks see different gradients, as
            with different data).
        df: the Student-t's degrees of freedom (default: the emulation's).
        draws: another net's :attr:`draws` to share (they are read, never
            written; drawing them costs seconds on a large model).
    """

    def __init__(
        self,
        emulation: Emulation,
        rank: int = 0,
        df: Optional[int] = None,
        draws: Optional[List[List[torch.Tensor]]] = None,
    ):
        super().__init__()
        self.emulation = emulation
        ordered = list(reversed(emulation.layers))  # forward (registration) order
        self.clock = _Clock()
        # Each layer's forward takes half its backward.
        self.backward_seconds = [x.backward for x in ordered]
        self.forward_seconds = [x.backward / 2 for x in ordered]
        self.params = nn.ParameterList(nn.Parameter(torch.zeros(x.numel)) for x in ordered)
        self.names = [x.name for x in ordered]
        if draws is None:
            draws = []
            for i, x in enumerate(ordered):
                g = torch.Generator().manual_seed(1_000_003 * (rank + 1) + i)
                draws.append(
                    [
                        student_t(x.numel, df or emulation.df, g).mul_(1.0 / math.sqrt(x.numel))
                        for _ in range(DRAWS)
                    ]
                )
        self.draws = draws
        self.step = 0

    def named_parameters(self, prefix: str = "", recurse: bool = True, **kwargs):  # type: ignore[override]
        """The emulated model's own tensor names (``layer1.0.conv1.weight``)."""
        for name, p in zip(self.names, self.params):
            yield name, p

    def gradient(self, i: int) -> torch.Tensor:
        """Layer ``i``'s gradient for this step (autograd copies it into ``.grad``)."""
        return self.draws[i][self.step % DRAWS]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        self.clock.start()
        h = x
        for i, p in enumerate(self.params):
            h = _Layer.apply(h, p, self, i)
        return h


def student_t(n: int, df: float, g: torch.Generator) -> torch.Tensor:
    """``n`` draws of a Student-t with ``df`` (> 0) degrees of freedom, seeded
    from ``g`` (``torch.distributions.StudentT`` draws from the global
    generator: it runs under a forked one, seeded from ``g``, so the caller's
    global state is left as it was)."""
    if isinstance(df, bool) or not isinstance(df, (int, float)) or not 0 < df < math.inf:
        raise ValueError(f"df must be a finite number > 0, got {df!r}")
    seed = int(torch.randint(0, 2**62, (), generator=g))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.distributions.StudentT(float(df)).sample((n,))


def measure_layers(
    model: nn.Module, data: Tuple[torch.Tensor, torch.Tensor], loss: Callable, steps: int = 5
) -> List[LayerProfile]:
    """Per-layer backward seconds of ``model`` on this machine, in
    gradient-ready order: the gap between successive gradients becoming ready
    (``register_post_accumulate_grad_hook``), the first from the start of
    ``backward()``; medians over ``steps`` steps after two untimed ones."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    stamps: Dict[str, List[float]] = {n: [] for n, _ in params}
    now: Dict[str, float] = {}
    handles = [
        p.register_post_accumulate_grad_hook(
            lambda _p, n=n: now.__setitem__(n, time.perf_counter())
        )
        for n, p in params
    ]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = data
    try:
        for s in range(steps + 2):
            opt.zero_grad()
            out = loss(model(x), y)
            now.clear()
            t0 = time.perf_counter()
            out.backward()
            opt.step()
            if s >= 2:
                for n, t in now.items():
                    stamps[n].append(t - t0)
    finally:
        for h in handles:
            h.remove()
    ready = sorted((statistics.median(ts), n) for n, ts in stamps.items() if ts)
    numel = {n: p.numel() for n, p in params}
    out_layers, last = [], 0.0
    for t, n in ready:
        out_layers.append(LayerProfile(n, numel[n], max(t - last, 0.0)))
        last = max(last, t)
    return out_layers


def _top_ratio(g: torch.Tensor, density: float) -> float:
    """The selection threshold at ``density`` over the mean magnitude: what
    the dynamic controller learns (its threshold is a factor times mean |a|)."""
    a = g.detach().reshape(-1).abs().float()
    k = max(1, math.ceil(density * a.numel()))
    return float(torch.topk(a, k, sorted=False).values.min() / a.mean().clamp_min(1e-30))


def fit_tail(
    density: float = 0.01,
    dfs: Sequence[int] = (2, 3, 4, 5, 6, 8, 12, 30),
    min_numel: int = 1024,
    steps: int = 3,
    models: Optional[Sequence[str]] = None,
) -> Tuple[Dict[str, int], Dict[str, List[float]], Dict[int, float]]:
    """Fit the Student-t's degrees of freedom to real gradients.

    Trains each of the benchmark's torch ``models`` (default: all) ``steps``
    SGD steps on its synthetic batch and takes, for every tensor of at least
    ``min_numel`` elements, the ratio of its ``density`` top-k threshold to
    its mean magnitude; then picks the ``df`` whose ratio (1M draws) is
    nearest, in log, the median ratio of each model's tensors (and, as
    ``"all"``, of every tensor).

    Returns:
        ``(df by model and "all", ratios by model, ratio by df)``.
    """
    from .train_torch import MODELS as SPECS

    ratios: Dict[str, List[float]] = {}
    for name in models or list(SPECS):
        spec = SPECS[name]
        torch.manual_seed(0)
        model = spec.build()
        x, y = spec.make_batch(spec.batch, torch.Generator().manual_seed(1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(steps):
            opt.zero_grad()
            spec.loss(model(x), y).backward()
            opt.step()
        ratios[name] = [
            _top_ratio(p.grad, density)
            for p in model.parameters()
            if p.grad is not None and p.numel() >= min_numel and bool(p.grad.abs().sum() > 0)
        ]
    g = torch.Generator().manual_seed(0)
    by_df = {df: _top_ratio(student_t(1 << 20, df, g), density) for df in dfs}

    def nearest(rs: Sequence[float]) -> int:
        target = statistics.median(rs)
        return min(by_df, key=lambda df: abs(math.log(by_df[df] / target)))

    best = {name: nearest(rs) for name, rs in ratios.items()}
    best["all"] = nearest([r for rs in ratios.values() for r in rs])
    return best, ratios, by_df


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m benchmarks.emulate``: fit the gradient distribution and print it."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.emulate",
        description="Fit the emulated gradients' Student-t to the benchmark models' gradients.",
    )
    parser.add_argument("--density", type=float, default=0.01)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    best, ratios, by_df = fit_tail(args.density)
    every = [r for rs in ratios.values() for r in rs]
    print(f"threshold / mean |g| at density {args.density:g}, tensors of >= 1024 elements:")
    print("| model | tensors | median | p10 | p90 | nearest df |")
    print("|---|---:|---:|---:|---:|---:|")
    from .report import percentile

    for name, rs in [*ratios.items(), ("all", every)]:
        print(
            f"| {name} | {len(rs)} | {statistics.median(rs):.2f} | {percentile(rs, 0.1):.2f} "
            f"| {percentile(rs, 0.9):.2f} | {best[name]} |"
        )
    print()
    print("| Student-t df | " + " | ".join(str(d) for d in by_df) + " |")
    print("|---|" + "---:|" * len(by_df))
    print("| ratio | " + " | ".join(f"{v:.2f}" for v in by_df.values()) + " |")
    print("\n(a Gaussian's ratio is 3.23)")


if __name__ == "__main__":
    main()
