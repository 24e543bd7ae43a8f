"""Typed, validated configuration of the sparsifier.

All user-facing knobs live in one frozen dataclass so that the PyTorch and
TensorFlow adapters accept exactly the same options and raise exactly the same
errors. Every field is documented with what it trades.
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Iterable, Mapping, Set
from dataclasses import asdict, dataclass, field
from typing import Optional, Tuple, Union

from ._checks import check_float, check_int

__all__ = [
    "Controller",
    "dgc_warmup",
    "IndexCoding",
    "MASKING_MAX_DENSITY",
    "MERGE_STRATEGIES",
    "MergeConfig",
    "ValueDType",
    "SparsityConfig",
]


class Controller(str, enum.Enum):
    """How each layer's selection threshold is chosen.

    * ``DYNAMIC`` (default): per-layer threshold adjusted every step from the
      count it selected in the previous step (a log-domain secant controller,
      no sort on the hot path), re-anchored to the exact top-k threshold every
      ``anchor_every`` steps.
    * ``TOPK``: exact k-th largest magnitude every step (the accuracy reference;
      a partial sort per layer per step).
    * ``FIXED``: one constant threshold for every layer (Strom, 2015); the
      number selected floats freely and is capped at the layer's capacity.
    * ``DGC``: threshold from the exact top-k of a strided sample of
      ``sample_ratio`` of the elements (Lin et al., 2018).
    """

    DYNAMIC = "dynamic"
    TOPK = "topk"
    FIXED = "fixed"
    DGC = "dgc"


class ValueDType(str, enum.Enum):
    """Dtype of the gradient values on the wire (see :class:`IndexCoding` for
    the indices)."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class IndexCoding(str, enum.Enum):
    """How a sparse message carries its indices (``dlgs.core.wire``).

    * ``AUTO`` (default): per message, whichever of the three below is
      smallest, decided from the layers' sizes and capacities alone, so every
      rank decides the same without a handshake.
    * ``INT32``: 4 bytes per selected element.
    * ``BLOCK16``: each index's low 16 bits (2 bytes per element) and, per
      layer, one int32 count for each 65,536-element block boundary (how many
      selected indices lie below it); exact for any layer size. Smaller than
      int32 unless a layer sends fewer than one element per 32,768.
    * ``BITMAP``: one bit per element of the layer (and one per slot of its
      capacity, for the padding): ``(n + capacity) / 8`` bytes whatever the
      number selected. Smaller than block16 above a density of about 1/15;
      the receiver unpacks every bit of every rank's message (work in
      proportion to the layer, not to the selection).
    """

    AUTO = "auto"
    INT32 = "int32"
    BLOCK16 = "block16"
    BITMAP = "bitmap"


@dataclass(frozen=True)
class SparsityConfig:
    """Options of dynamic layer-wise gradient sparsification.

    Args:
        density: Fraction of each sparsified layer's elements sent per step, in
            (0, 1]. Lower sends fewer bytes but lets more gradient wait in the
            residual; DGC reports 0.001 without accuracy loss on ImageNet and
            PTB once warm-up is used. ``1.0`` sends every layer dense (exactly
            Horovod's allreduce). Start at 0.01. ``"auto"``: the merge planner
            picks it from its profile (:func:`dlgs.core.planning.profile.choose_density`):
            the highest density, between ``density_floor`` and dense,
            predicted to end within ``auto_slack`` of back-propagation after
            the fastest; with ``refine`` the steps under it are timed and it
            is kept only if they end no later than the profiled ones (by a
            margin above the noise, or ``auto_slack`` later for a higher
            density), else 0.01 stays. 0.01 (or the floor) until the first
            profile. Needs a profiling ``merge`` (not ``"none"``); not with
            ``warmup``. See docs/options.md.
        density_floor: ``density="auto"`` only: the lowest density it may
            choose, in (0, 1]. Lower lets slow links still hide communication,
            at the accuracy cost of very sparse updates (0.001 needs warm-up,
            see ``warmup``).
        auto_slack: ``density="auto"`` only: how much later than the
            fastest density's the chosen one may end (predicted, and measured
            for one above the starting density), as a fraction of
            back-propagation, >= 0. Larger picks higher densities
            (more accuracy) at the price of a slower step.
        auto_layers: ``density="auto"`` only: also raise single layers above
            the chosen density where their extra bytes are predicted to fit
            in the same bound (:func:`dlgs.core.planning.profile.raise_layers`);
            usually the layers whose gradients are ready early, which have
            the rest of back-propagation to hide behind. More of the gradient
            sent for the same predicted step time; False: one density for
            every layer.
        controller: Threshold controller, see :class:`Controller`.
        max_ratio: Capacity of each layer's message as a multiple of its target
            ``k = ceil(density * n)``; messages have a fixed size so that no
            step needs the selected count on the host. Above 1.0 the wire
            carries padding when the controller undershoots; at 1.0 (default)
            the wire carries exactly ``density`` and any overshoot waits in the
            residual for the next step (nothing is lost).
        min_sparse_size: Layers with fewer elements are sent dense (biases,
            norms): sparsifying them saves almost nothing and costs latency.
        anchor_every: ``dynamic`` only: every this many steps the threshold is
            reset to the exact top-k threshold (one partial sort). 0 anchors
            only at the first step. Smaller tracks the target more tightly,
            larger is cheaper.
        threshold: ``fixed`` only: the constant magnitude threshold.
        sample_ratio: ``dgc`` only: fraction of elements sampled to estimate
            the threshold. Larger is more accurate and slower.
        momentum: DGC momentum correction. 0 (default) accumulates raw
            gradients; > 0 accumulates velocity ``u = m*u + g`` locally and
            clears the residual (and with ``momentum_masking`` the velocity)
            where values were sent. When set, give the wrapped optimizer
            ``momentum=0``.
        momentum_masking: With ``momentum``: also clear the velocity where
            values were sent (DGC's factor masking). Masking restarts a
            coordinate's momentum each time it is sent, so the more often it is
            sent the less momentum it gets: sent every step, none at all (at
            ``m = 0.9`` a 10x smaller step than momentum SGD), which is what
            high densities and DGC's warm-up stages do to the largest
            gradients. ``False`` keeps the velocity: what is sent then sums to
            exactly what momentum SGD applies, delayed by the residual, at
            every density; at a steady low density masking does better (a sent
            coordinate's momentum would keep pushing). ``None`` (default): no
            masking with ``warmup``; without it, each layer masked only where
            its density is at most :data:`MASKING_MAX_DENSITY` (measured:
            docs/benchmarks.md, "Warm-up" and "Accuracy per byte").
        warmup: Densities for the first stages of training, e.g.
            ``(0.25, 0.063, 0.015, 0.004)``, or ``"dgc"``: DGC's schedule scaled
            to ``density`` (:func:`dgc_warmup`: 4 stages from 0.25 down to
            ``density`` by equal factors; at 0.001 0.25, 0.0629, 0.0158,
            0.00398, within 2% of DGC's 0.25, 0.0625, 0.015625, 0.004). Each
            stage lasts ``warmup_steps`` steps, then ``density`` applies.
            Message sizes change only at stage boundaries.
        warmup_steps: Steps per warm-up stage.
        value_dtype: ``"auto"`` (default), ``"float32"``, ``"float16"`` or
            ``"bfloat16"`` values on the wire. ``auto``: float16 under a
            ``budget`` (4 bytes an entry instead of 6 with 16-bit indices, so
            the same bytes send about 1.5x the entries) unless float32 fits it
            at density 1.0 (then every layer is summed as plain Horovod
            does), float32 otherwise.
            The 16-bit dtypes halve the value bytes; the rounding
            error stays in the residual, so nothing is lost over time. float16
            keeps 11 bits of mantissa but tops out at 65504 (larger values are
            sent clipped, the rest waits in the residual); bfloat16 keeps
            float32's range with 8 bits of mantissa.
        budget: Bytes this rank may send per step, as an int (``>= 1``), or
            as a fraction of the dense float32 gradient's bytes (a float in
            (0, 1)); None (default): ``density`` decides. With a budget dlgs
            chooses the density: the largest at which the layer-wise layout
            (sparse layers at capacity, the small layers dense) fits, counted
            from the same arithmetic as ``wire_bytes()``; the merge planner
            then never sends an eligible layer dense (its plans send no more
            than that). A budget below what the small layers and one entry per
            sparse layer cost is a ``ValueError`` at the first gradient. Not
            with ``density="auto"``, warm-up or the reduction (whose bytes
            depend on the ranks). With ``topology="hierarchical"`` it is what
            each rank sends between nodes (its shard's messages).
        budget_split: With ``budget``: ``"uniform"``, one density for
            every sparse layer; ``"gradient"``, after 10 steps at that
            density, each layer's own, as a global top-k of the residuals
            would split the same bytes (one host read of a sample of them
            on rank 0 and one broadcast, once;
            :mod:`dlgs.core.planning.budget`). Small layers, starved by one
            density, get more of the bytes, large ones less. ``"auto"``
            (default): ``"gradient"`` under a budget, else ``"uniform"``
            (no budget to split); the config holds the resolved value.
        dense_dtype: ``"float32"`` (default), ``"float16"`` or ``"bfloat16"``:
            the dtype of dense messages on the wire (layers below
            ``min_sparse_size``, layers the merge plan sends dense, the fused
            tail), cast back to float32 on arrival. A 16-bit dtype halves
            their bytes, which the planner prices; unlike ``value_dtype`` the
            rounding is not fed back (dense layers keep no residual), as with
            Horovod's ``Compression.fp16``. float16 tops out at 65504 and its
            sum over the ranks may overflow to inf (a loss scaler then skips
            the step on every rank); bfloat16 has float32's range but 8 bits
            of mantissa, and Horovod 0.28.1 cannot allreduce it (the DDP hook
            only).
        index_coding: ``"auto"`` (default), ``"int32"``, ``"block16"`` or
            ``"bitmap"``, see :class:`IndexCoding`. ``auto`` sends about 2
            bytes per index instead of 4 (less than 2 above density 1/15, as a
            bitmap) at no loss (indices decode exactly) for a few more device
            operations per step on the receiver; ``int32`` is the simplest
            format.
        kernels: How a sparse layer's selection runs on the device.
            ``"auto"`` (default): fused Triton kernels where the gradient is
            on a CUDA device and Triton imports (three kernels per sparse
            layer instead of about 18, plus the controller's two), else the
            framework's own operations. ``"torch"``: always the framework's
            operations (the reference; what the CPU runs). ``"triton"``:
            always the fused kernels, an error where they cannot run (on CPU
            tensors only under Triton's interpreter, ``TRITON_INTERPRET=1``:
            slow, for tests). Given the same threshold both select, send and
            keep the same bits; the dynamic controller's threshold follows
            the sum of ``|a|``, which the kernels add in another order, so
            its selection may differ at the margin. See docs/gpus.md.
        transport: How sparse messages travel. ``"allgather"`` (default):
            every rank gathers every rank's selection, ``(P - 1) k`` values
            received per rank. ``"reduce"``: a sparse reduction by regions
            (:mod:`dlgs.core.transport.reduction`): each rank sends the entries of each
            of ``P`` regions to its owner, the owners sum them and every rank
            gathers the sums, about ``2 reduce_width k`` entries sent and
            as many received per rank whatever ``P`` is, in the message's
            value dtype and with 16-bit offsets where smaller; what a rank
            could not send or an owner did not keep goes back into that
            rank's residual. Two collectives per message instead of one;
            PyTorch only so far, without momentum correction. ``"auto"``:
            each sparse message by whichever of the two is predicted faster
            (:mod:`dlgs.core.transport.routing`): the merge planner's choice where it
            planned (from the measured allgather), else a rule on the
            message's bytes (the reduction for large messages from three
            ranks on); the allgather alone without an alltoall
            (TensorFlow).
        reduce_width: With ``transport="reduce"``, each block's entries as a
            multiple of the message's capacity over the ranks, in [0.25, 64]:
            each rank sends each owner at most ``reduce_width * cap / P``
            entries and each owner keeps that many sums (its share of a
            top-k of ``reduce_width * cap``). Wider sends more bytes and
            holds back less (entries past a crowded region's block, sums an
            owner could not keep); narrower the reverse.
    """

    density: Union[float, str] = 0.01
    density_floor: float = 0.001
    auto_slack: float = 0.05
    auto_layers: bool = True
    controller: Controller = Controller.DYNAMIC
    max_ratio: float = 1.0
    min_sparse_size: int = 1024
    anchor_every: int = 32
    threshold: Optional[float] = None
    sample_ratio: float = 0.01
    momentum: float = 0.0
    momentum_masking: Optional[bool] = None
    warmup: Tuple[float, ...] = field(default_factory=tuple)
    warmup_steps: int = 0
    value_dtype: ValueDType = "auto"  # type: ignore[assignment]  # resolved below
    dense_dtype: ValueDType = ValueDType.FLOAT32
    budget: Optional[Union[int, float]] = None
    budget_split: str = "auto"
    index_coding: IndexCoding = IndexCoding.AUTO
    kernels: str = "auto"
    transport: str = "allgather"
    reduce_width: float = 1.25
    #: Whether ``value_dtype="auto"`` chose the values' dtype (not an option:
    #: set by the checks, left out of :meth:`to_dict`).
    values_chosen: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.density, str) and self.density == "auto"):
            if isinstance(self.density, str):
                raise TypeError(
                    f"density must be a finite float in (0, 1] or 'auto', got {self.density!r}"
                )
            check_float("density", self.density, low=0, high=1, low_open=True)
        check_float("density_floor", self.density_floor, low=0, high=1, low_open=True)
        check_float("auto_slack", self.auto_slack, low=0)
        if not isinstance(self.auto_layers, bool):
            raise TypeError(f"auto_layers must be a bool, got {type(self.auto_layers).__name__}")
        object.__setattr__(self, "controller", _member(Controller, "controller", self.controller))
        object.__setattr__(
            self, "dense_dtype", _member(ValueDType, "dense_dtype", self.dense_dtype)
        )
        self._check_budget()
        if isinstance(self.value_dtype, str) and self.value_dtype == "auto":
            # At a budget 16-bit values buy entries: 1.5x as many for the same
            # bytes, which won on the transformer LM at PowerSGD rank 4's
            # bytes (docs/benchmarks.md).
            auto = ValueDType.FLOAT16 if self.budget is not None else ValueDType.FLOAT32
            object.__setattr__(self, "value_dtype", auto)
            object.__setattr__(self, "values_chosen", True)
        object.__setattr__(
            self, "value_dtype", _member(ValueDType, "value_dtype", self.value_dtype, "'auto'")
        )
        object.__setattr__(
            self, "index_coding", _member(IndexCoding, "index_coding", self.index_coding)
        )
        if not isinstance(self.kernels, str):
            raise TypeError(f"kernels must be a str, got {type(self.kernels).__name__}")
        if self.kernels not in KERNELS:
            raise ValueError(
                f"kernels must be one of {', '.join(map(repr, KERNELS))}, got {self.kernels!r}"
            )
        if not isinstance(self.transport, str):
            raise TypeError(f"transport must be a str, got {type(self.transport).__name__}")
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"transport must be one of {', '.join(map(repr, TRANSPORTS))}, "
                f"got {self.transport!r}"
            )
        if self.transport != "allgather" and self.momentum:
            raise ValueError(
                f"transport={self.transport!r} does not support momentum correction yet: "
                f"momentum must be 0 with it, got {self.momentum!r}"
            )
        check_float("max_ratio", self.max_ratio, low=1.0, high=16.0)
        check_float("reduce_width", self.reduce_width, low=0.25, high=64.0)
        check_int("min_sparse_size", self.min_sparse_size, 1)
        check_int("anchor_every", self.anchor_every, 0)
        check_int("warmup_steps", self.warmup_steps, 0)
        if self.controller is Controller.FIXED:
            if self.threshold is None:
                raise ValueError(
                    "threshold is required (a finite float > 0) when controller='fixed'"
                )
            check_float("threshold", self.threshold, low=0, low_open=True)
        elif self.threshold is not None:
            raise ValueError("threshold is only used with controller='fixed'")
        check_float("sample_ratio", self.sample_ratio, low=0, high=1, low_open=True)
        check_float("momentum", self.momentum, low=0, high=1, high_open=True)
        if self.momentum_masking is not None and not isinstance(self.momentum_masking, bool):
            raise TypeError(
                "momentum_masking must be a bool or None, got "
                f"{type(self.momentum_masking).__name__}"
            )
        if self.auto and (self.warmup or self.warmup_steps):
            raise ValueError(
                "warmup/warmup_steps need a fixed density; with density='auto' the planner "
                "chooses it (use density_floor to bound it)"
            )
        if isinstance(self.warmup, str) and self.warmup == "dgc":
            object.__setattr__(self, "warmup", dgc_warmup(self.density))
        # A bare float is not iterable and a str iterates its characters: both
        # are a mistaken list of stage densities, refused by name.
        if not isinstance(self.warmup, Iterable) or isinstance(
            self.warmup, (str, bytes, Mapping, Set)
        ):
            raise TypeError(
                "warmup must be a sequence of densities in (0, 1], e.g. (0.25, 0.063), "
                f"or 'dgc', got {self.warmup!r}"
            )
        warmup = tuple(self.warmup)
        for i, d in enumerate(warmup):
            check_float(f"warmup[{i}]", d, low=0, high=1, low_open=True)
        object.__setattr__(self, "warmup", warmup)
        if warmup and self.warmup_steps == 0:
            raise ValueError("warmup_steps must be an int >= 1 when warmup is given")
        if self.momentum_masking is None and warmup:
            # Masking starves coordinates sent nearly every step (warm-up's
            # dense stages) of momentum; at a steady low density it helps
            # (without warm-up, :meth:`masks` decides per layer).
            object.__setattr__(self, "momentum_masking", False)

    def masks(self, k: int, numel: int) -> bool:
        """Whether momentum correction masks (``momentum_masking``) a sparse
        layer of ``numel`` elements sending ``k`` a step: as set, or by
        default where ``k`` is at most the count :data:`MASKING_MAX_DENSITY`
        gives the layer."""
        if self.momentum_masking is not None:
            return self.momentum_masking
        return k <= math.ceil(MASKING_MAX_DENSITY * numel)

    @property
    def auto(self) -> bool:
        """``density="auto"``: the planner chooses the density."""
        return isinstance(self.density, str)

    def density_at(self, step: int) -> float:
        """Density in force at optimizer step ``step`` (0-based), warm-up
        included; with ``density="auto"``, :data:`AUTO_START` or the floor if
        higher (the exchange applies the planner's choice once made)."""
        if self.auto:
            return max(AUTO_START, self.density_floor)
        if self.warmup_steps and step < len(self.warmup) * self.warmup_steps:
            return self.warmup[step // self.warmup_steps]
        return float(self.density)

    def _check_budget(self) -> None:
        b = self.budget
        if self.budget_split == "auto":
            # Under a budget the split won on Fashion-MNIST and the
            # transformer LM (docs/benchmarks.md).
            object.__setattr__(self, "budget_split", "gradient" if b is not None else "uniform")
        if self.budget_split not in BUDGET_SPLITS:
            raise ValueError(
                f"budget_split must be one of {', '.join(map(repr, BUDGET_SPLITS))}, "
                f"got {self.budget_split!r}"
            )
        if b is None:
            if self.budget_split != "uniform":
                raise ValueError(
                    f"budget_split={self.budget_split!r} splits a byte budget: pass budget= too"
                )
            return
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise TypeError(f"budget must be an int or a float, got {type(b).__name__}")
        if isinstance(b, int) and b < 1 or isinstance(b, float) and not 0.0 < b < 1.0:
            raise ValueError(
                "budget must be bytes per step (an int >= 1) or a fraction of the dense "
                f"gradient's bytes (a float in (0, 1)), got {b!r}"
            )
        for clash, why in (
            (self.auto, "density='auto' chooses the density from the profile"),
            (bool(self.warmup), "warm-up stages send more than the budget"),
            (self.transport != "allgather", "the reduction's bytes per step depend on the ranks"),
        ):
            if clash:
                raise ValueError(f"budget={b!r} cannot be combined here: {why}")

    def to_dict(self) -> dict:
        """Plain-Python form, for logging, checkpoints and cross-rank checks."""
        d = asdict(self)
        del d["values_chosen"]
        d["controller"] = self.controller.value
        d["value_dtype"] = self.value_dtype.value
        d["dense_dtype"] = self.dense_dtype.value
        d["index_coding"] = self.index_coding.value
        d["warmup"] = list(self.warmup)
        return d


def _member(kind, name: str, value, *more: str):
    """``kind(value)`` for an enum option, or ValueError naming it and its
    values (and ``more`` accepted spellings)."""
    try:
        return kind(value)
    except ValueError:
        names = ", ".join([repr(c.value) for c in kind] + list(more))
        raise ValueError(f"{name} must be one of {names}, got {value!r}") from None


#: ``momentum_masking=None`` masks a layer (without warm-up) only at or below
#: this density: on Fashion-MNIST masking did better at 0.001 and 0.006 and
#: worse at 0.024 and 0.25 (docs/benchmarks.md, "Accuracy per byte").
MASKING_MAX_DENSITY = 0.01

#: The values of ``SparsityConfig.budget_split``.
BUDGET_SPLITS = ("auto", "uniform", "gradient")

#: The values of ``SparsityConfig.kernels``.
KERNELS = ("auto", "torch", "triton")
#: The values of ``SparsityConfig.transport``.
TRANSPORTS = ("allgather", "reduce", "auto")

#: The density ``density="auto"`` starts at, until the planner has chosen.
AUTO_START = 0.01


def dgc_warmup(density: float, stages: int = 4, start: float = 0.25) -> Tuple[float, ...]:
    """DGC's warm-up schedule scaled to a target density: ``stages`` densities
    from ``start`` down towards ``density`` by equal factors (Lin et al., 2018,
    use 0.25, 0.0625, 0.015625, 0.004 for 0.001: this returns 0.25, 0.0628,
    0.0158, 0.00397). Empty when ``density >= start`` (nothing to warm up)."""
    check_float("density", density, low=0, high=1, low_open=True)
    if density >= start:
        return ()
    ratio = (density / start) ** (1.0 / stages)
    return tuple(start * ratio**j for j in range(stages))


MERGE_STRATEGIES = ("dp", "none", "all", "buckets", "greedy")


@dataclass(frozen=True)
class MergeConfig:
    """How layers are merged into messages: the merge plan's options.

    Pass the fields as keywords to any entry point (``merge="dp",
    profile_steps=3``) or a ready ``merge=MergeConfig(...)``. Each field is
    defined, defaulted and validated here once.

    Args:
        strategy: ``"dp"`` (default): profile ``profile_steps`` steps, then the
            plan that minimises the predicted iteration end, each message sparse
            or dense; ``"none"``: one message per layer, no profiling; ``"all"``:
            one message for every sparsified layer; ``"buckets"``: consecutive
            layers in buckets of ``bucket_elements`` elements (OMGS-SGD);
            ``"greedy"``: the MG-WFBP / OMGS merge rule. Given as ``merge=``.
        profile_steps: steps timed before planning, and again under the first
            plan before it is refined; also the guard's samples on each side.
            More gives steadier medians and a guard that rejects smaller real
            differences; the final plan starts later (``2 * profile_steps + 3``
            steps; ``3 * profile_steps + 4`` where ``density="auto"``'s choice
            measures slower and the starting density is timed again).
        bucket_elements: elements per bucket for ``"buckets"``.
        max_group: most layers in one message for ``"dp"`` (None: any). Bounds
            planning time on models with hundreds of layers but forbids the
            few-message plans that win when latency dominates.
        drift_tolerance: re-profile and re-plan when the median step time of a
            ``drift_window``-step window moves by more than this fraction from
            the first window after the plan. Smaller reacts sooner, and to noise.
        drift_window: steps per drift window (0: never re-plan on its own).
        refine: time ``profile_steps`` steps under a fresh plan and plan once
            more from them (the first profile cannot see how the plan's own
            messages slow back-propagation).
        guard: ``"dp"`` with ``refine``: drop a plan for layer-wise sending
            if its timed steps ended later than the layer-wise ones by more
            than the noise of both samples (medians, a margin of twice the
            standard error of their difference estimated from the median
            absolute deviations, at least 2%); within the noise the one that
            sends fewer bytes (a plan that sends more than layer-wise sending
            must measure faster beyond the noise), a rule every run agrees on.
        profile_budget: the share of the run that profiling may cost after the
            first profile: a re-profile (after drift) waits until the planner's
            host time so far, plus what the last profile took, is below this
            fraction of the elapsed time; a profile's probes spend at most this
            share of the bytes 1,000 steps of the layout in force send, and
            probes never spend more bytes than sparse sending has saved against
            dense float32 so far (re-profiles keep the fitted collectives when
            it has not). Smaller re-plans less often after drift.
        link_bandwidth: the bandwidth of the slowest link between the ranks,
            in bit/s (``1e9`` for 1 Gbit/s Ethernet), or None (the default):
            what the plan prices bytes at when the probes cannot see them. The
            probes' sizes are bounded by ``profile_budget``; on a slow link
            their bytes may take less time than the noise, and then, without
            this, the plan prices bytes at the most the samples allow, which
            moves with the noise from run to run (on 1 Gbit/s here: 1.7 to 13.5
            ns/B, plans of 2.9 to 10.7 MB per step). With it, bytes the
            probes did not see are priced as a ring over this link (8 ns/B per
            rank's chunk and peer at 1 Gbit/s), the same in every run; bytes
            the probes saw keep the measured price. Too low a value keeps the
            plan near layer-wise sparse sending, too high one sends more dense.
        calibration_file: a path, or None (the default): where the fitted
            collectives are kept between jobs. A job that finds a file there
            written at its world size plans from it without probing (so from
            the first profiled steps, and from the same collectives as the job
            that wrote it); otherwise it probes and rank 0 writes the file.
            Name it per cluster and interconnect: a file from another network
            prices this one's bytes wrongly until drift re-profiles.
    """

    strategy: str = "dp"
    profile_steps: int = 8
    bucket_elements: int = 8192
    max_group: Optional[int] = None
    drift_tolerance: float = 0.25
    drift_window: int = 50
    refine: bool = True
    guard: bool = True
    profile_budget: float = 0.01
    link_bandwidth: Optional[float] = None
    calibration_file: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, str):
            raise TypeError(f"merge must be a str, got {type(self.strategy).__name__}")
        if self.strategy not in MERGE_STRATEGIES:
            names = ", ".join(repr(s) for s in MERGE_STRATEGIES)
            raise ValueError(f"merge must be one of {names}, got {self.strategy!r}")
        check_int("profile_steps", self.profile_steps, 1)
        check_int("bucket_elements", self.bucket_elements, 1)
        # Checked here, not only when planning: a bad value must fail at
        # construction, not several steps into training.
        check_int("max_group", self.max_group, 1, none_ok=True)
        check_float("drift_tolerance", self.drift_tolerance, low=0, low_open=True)
        check_int("drift_window", self.drift_window, 0)
        check_float("profile_budget", self.profile_budget, low=0, high=1, low_open=True)
        if self.link_bandwidth is not None:
            check_float("link_bandwidth", self.link_bandwidth, low=0, low_open=True)
        if self.calibration_file is not None:
            if not isinstance(self.calibration_file, (str, os.PathLike)):
                raise TypeError(
                    "calibration_file must be None or a path (str or os.PathLike), got "
                    f"{type(self.calibration_file).__name__}"
                )
            # Plain str: compared across ranks and carried in the options.
            path = os.fspath(self.calibration_file)
            if not os.path.basename(path.rstrip(os.sep)) or path.endswith(os.sep):
                raise ValueError(f"calibration_file must name a file, got {path!r}")
            object.__setattr__(self, "calibration_file", path)
        for name in ("refine", "guard"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")

    def to_dict(self) -> dict:
        """Plain-Python form, for logging and cross-rank checks."""
        return asdict(self)
