"""Glue between TensorFlow variables, Horovod's TF collectives and the core.

:class:`Engine` owns one :class:`~dlgs.core.exchange.exchange.SparseExchange` (and its
:class:`~dlgs.core.planning.online.OnlinePlanner`) over a fixed list of variables, and
exchanges a list of gradients for them, the way ``dlgs/torch/_engine.py`` and
the torch optimizer drive the same core:

* eagerly, :meth:`Engine.exchange` submits every gradient to the exchange in
  backward order (last layer first) and waits;
* while a ``tf.function`` is being traced, it inserts a ``tf.cond`` between
  the exchange traced into graph ops (steps that need no host work) and one
  ``tf.py_function`` that runs the same eager code (steps that do: profiling,
  planning, anchors, a new layout), :class:`~dlgs.tensorflow._graph.GraphSteps`
  and docs/tensorflow.md.

Eager collectives run on one background thread in submission order (the same
order on every rank), so a message's allgather overlaps the selection of the
next messages, as the planner's model assumes; traced ones are Horovod's
graph ops.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Tuple

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from .. import _options
from .._horovod import (
    HorovodSet,
    check_dense_dtype,
    check_two_level_set,
    shutdown_explained,
    two_levels,
    watch_exit,
)
from .._options import check_topology
from ..core.engine import Engine as CoreEngine
from ..core.engine import check_unique_names
from ..core.registry import Registry
from ._graph import GraphSteps
from ._ops import OPS, _read, as_input

__all__ = [
    "ENGINES",
    "DlgsAccessors",
    "Engine",
    "HorovodCollectives",
    "HorovodNodeCollectives",
    "build_tf_configs",
    "topology_options",
    "variable_name",
]

logger = logging.getLogger(__name__)


def variable_name(v: Any) -> str:
    """A stable name for a variable: ``v.path`` for a Keras 3 variable (e.g.
    ``"dense/kernel"``), ``v.name`` for a ``tf.Variable``."""
    path = getattr(v, "path", None)
    if isinstance(path, str) and path:
        return path
    name = getattr(v, "name", None)
    if isinstance(name, str) and name:
        return name
    raise TypeError(f"expected a tf.Variable or keras.Variable, got {type(v).__name__}")


def build_tf_configs(
    config: Any, density: Any, merge: Any, options: Dict[str, Any], *, door: str
) -> Tuple[Any, Any, Tuple[str, Optional[int]]]:
    """:func:`dlgs._options.build_configs` for a TensorFlow door, and its
    ``(topology, ranks_per_node)`` (taken out of ``options``): what it
    refuses is refused at construction, naming the option and why (not at the
    first step, inside TensorFlow's error)."""
    if os.environ.get("HOROVOD_ELASTIC") == "1":  # set by horovodrun for elastic jobs
        raise ValueError(
            f"{door} does not run under Horovod Elastic: a reset would restore the model and "
            "optimizer from hvd.elastic's TensorFlowKerasState but not dlgs' residuals and "
            "thresholds, which that state does not hold, so ranks would go on from different "
            "states. Use Horovod's own optimizer or tape for elastic TensorFlow jobs, or dlgs' "
            "torch forms (docs/options.md, 'Which door has which feature')"
        )
    options = dict(options)
    topology = (options.pop("topology", "flat"), options.pop("ranks_per_node", None))
    check_topology(*topology)
    cfg, planner = _options.build_configs(config, density, merge, options, door=door)
    check_dense_dtype(cfg, door)
    if cfg.kernels == "triton":
        raise ValueError(
            "kernels='triton' is for PyTorch tensors; TensorFlow uses kernels='auto' or 'torch'"
        )
    return cfg, planner, topology


def topology_options(
    topology: Tuple[str, Optional[int]], op: Any = None, process_set: Any = None
) -> Dict[str, Any]:
    """The :class:`Engine` options of a door's ``(topology, ranks_per_node)``:
    the two-level exchange averages over every rank (``op=hvd.Average``, the
    global process set), refused otherwise by name."""
    kind, ranks_per_node = topology
    check_two_level_set(hvd, kind, op, process_set)
    if kind == "flat":
        watch_exit(hvd)  # a rank that leaves says so (two_levels does it otherwise)
        return {}
    return {
        "topology": two_levels(hvd, kind, ranks_per_node, _node_and_cross),
        "choose_topology": kind == "auto",
    }


def _node_and_cross(node, cross):
    """The two-level exchange's collectives on its Horovod process sets."""
    return HorovodNodeCollectives(node), HorovodCollectives(process_set=cross)


def _dtype(v: Any) -> tf.DType:
    return tf.as_dtype(v.dtype)


def _shape(v: Any) -> Tuple[int, ...]:
    shape = tuple(v.shape)
    if any(s is None for s in shape):
        raise ValueError(f"variable {variable_name(v)!r} has an unknown shape {shape}")
    return tuple(int(s) for s in shape)


class HorovodCollectives(HorovodSet):
    """:class:`dlgs.core.exchange.exchange.Collectives` on ``horovod.tensorflow`` (eager),
    on ``process_set`` (see :class:`dlgs._horovod.HorovodSet`).

    Horovod's TF ops have no asynchronous Python API; each collective is run
    eagerly on one worker thread (Horovod releases the GIL while it waits), so
    ``*_async`` return a future and messages go out in submission order.
    ``device_dense`` / ``device_sparse`` place the allreduces / allgathers.
    """

    hvd = hvd

    def __init__(
        self,
        op=hvd.Average,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        process_set=hvd.global_process_set,
        compression=hvd.Compression.none,
        device_dense: str = "",
        device_sparse: str = "",
    ):
        super().__init__(op, prescale_factor, postscale_factor, process_set, compression)
        self.device_dense = device_dense
        self.device_sparse = device_sparse
        self._pool: Optional[ThreadPoolExecutor] = None

    def _submit(self, fn, *args):
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dlgs-tf")
        return self._pool.submit(fn, *args)

    def allgather_async(self, chunk, name):
        if not tf.executing_eagerly():  # traced into a graph: Horovod's graph op
            t = _read(chunk)
            out = self._allgather(t, _graph_name(name))
            # Every rank's chunk has this rank's length (one layout on every
            # rank): a rank with another one fails here instead of unpacking.
            return tf.ensure_shape(out, [self.size * int(t.shape[0])] + list(t.shape[1:]))
        return self._submit(self._allgather, _read(chunk), name)

    def _allgather(self, tensor, name):
        with tf.device(self.device_sparse):
            return hvd.allgather(
                tensor, name=name, ignore_name_scope=True, process_set=self.process_set
            )

    def alltoall_async(self, tensor, name):
        """Equal blocks of a 1-D tensor to every rank (``transport="reduce"``)."""
        if not tf.executing_eagerly():
            return self._alltoall(_read(tensor), _graph_name(name))
        return self._submit(self._alltoall, _read(tensor), name)

    def _alltoall(self, tensor, name):
        with tf.device(self.device_sparse):
            return hvd.alltoall(
                tensor, name=name, ignore_name_scope=True, process_set=self.process_set
            )

    def allreduce_async(self, tensor, name):
        if not tf.executing_eagerly():
            return self._allreduce(_read(tensor), _graph_name(name))
        return self._submit(self._allreduce, _read(tensor), name)

    def _allreduce(self, tensor, name):
        with tf.device(self.device_dense):
            return hvd.allreduce(
                tensor,
                op=self.op,
                prescale_factor=self.prescale_factor,
                postscale_factor=self.postscale_factor,
                compression=self.compression,
                name=name,
                ignore_name_scope=True,
                process_set=self.process_set,
            )

    def synchronize(self, handle):
        # A graph's collective is its output tensor; an eager one a future.
        if not isinstance(handle, Future):
            return handle
        with shutdown_explained():
            return handle.result()

    def allgather_object(self, obj, name):
        return hvd.allgather_object(obj, name=name, process_set=self.process_set)

    def allreduce_min(self, values, name):
        """The element-wise minimum of small integers over the set (eager, on
        the collectives' thread, so it keeps its place among the others)."""

        def run():
            out = hvd.allreduce(
                tf.constant(list(values), tf.int64),
                op=hvd.Min,
                name=name,
                ignore_name_scope=True,
                process_set=self.process_set,
            )
            return [int(v) for v in out.numpy()]

        return self._submit(run).result()


class HorovodNodeCollectives:
    """:class:`dlgs.core.transport.hierarchical.NodeCollectives` on
    ``horovod.tensorflow`` (eager): the reduce-scatter (average), allgather and
    allreduce among one node's ranks, each run on this set's own thread in
    submission order (as :class:`HorovodCollectives`; a node's collectives
    never wait behind the cross-node ones, which each rank starts as its
    node's complete)."""

    def __init__(self, process_set):
        self.process_set = process_set
        self.size = process_set.size()
        self.rank = process_set.rank()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dlgs-tf-node")

    def _start(self, collective, tensor, name, **options) -> Future:
        # The tensor is read now: the buffer is reused.
        return self._pool.submit(
            collective,
            _read(tensor),
            name=name,
            ignore_name_scope=True,
            process_set=self.process_set,
            **options,
        )

    def reducescatter_async(self, tensor, name):
        return self._start(hvd.reducescatter, tensor, name, op=hvd.Average)

    def allgather_async(self, tensor, name):
        return self._start(hvd.allgather, tensor, name)

    def allreduce_async(self, tensor, name):
        return self._start(hvd.allreduce, tensor, name, op=hvd.Average)

    def synchronize(self, handle):
        with shutdown_explained():
            return handle.result()

    def poll(self, handle):
        return handle.done()


class Engine(CoreEngine):
    """The core engine over a fixed list of TensorFlow variables.

    Built lazily, eagerly (``tf.init_scope``), from the first gradient list it
    is given (:meth:`specs`), after checking that every rank has the same
    variables and options. Later calls must pass the same variables (by name).
    Arguments as :class:`dlgs.core.engine.Engine` (ops and logger are TF's).
    """

    def __init__(self, config, planner, comm, **kwargs: Any):
        super().__init__(OPS, comm, config, planner, logger=logger, **kwargs)
        self.shapes: List[Tuple[int, ...]] = []
        self._lock = threading.Lock()
        #: The exchange's state as one ``tf.train.Checkpoint`` entry.
        self.trackable = ExchangeState(self)
        #: The exchange's steps traced into the graph (:class:`~dlgs.tensorflow._graph.GraphSteps`).
        self.graph = GraphSteps(self)

    def _settle(self) -> None:
        self.graph.pull()

    def specs(self, variables: Sequence[Any]) -> List[str]:
        """Validated names of ``variables``; builds the exchange on first use."""
        names = [variable_name(v) for v in variables]
        if self.names is None:
            if not names:
                raise ValueError("no variables to exchange gradients for")
            check_unique_names("variable", names)
            shapes = [_shape(v) for v in variables]
            for v in variables:
                if not _dtype(v).is_floating:
                    raise TypeError(
                        f"variable {variable_name(v)!r} has dtype {_dtype(v).name}: only "
                        "floating-point variables have gradients to exchange"
                    )
            _options.warn_float64(
                "variables",
                [n for n, v in zip(names, variables) if _dtype(v) == tf.float64],
                logger,
            )
            with tf.init_scope():  # eager even while a tf.function is traced
                self.shapes = shapes
                self.build(
                    [(n, s, _dtype(v).name) for n, s, v in zip(names, shapes, variables)],
                    like=tf.zeros([1], tf.float32),
                    clock=_clock(),
                )
        elif names != self.names:
            raise ValueError(
                "this dlgs exchange was built for other variables "
                f"({len(self.names)} starting {self.names[:3]}), got {len(names)} starting "
                f"{names[:3]}; use one DistributedGradientTape name= / optimizer per variable list"
            )
        return names

    # -- the step -----------------------------------------------------------------
    def exchange_gradients(self, grads: Sequence[Any], variables: Sequence[Any]) -> List[Any]:
        """Reduced gradients for ``variables``, eagerly or via ``tf.py_function``.

        ``None`` gradients take part as zeros (every rank must submit every
        layer) and come back as ``None``; ``tf.IndexedSlices`` are densified.
        """
        if len(grads) != len(variables):
            raise ValueError(f"got {len(grads)} gradients for {len(variables)} variables")
        if not self.comm.included:
            # Outside the process set: this rank's own gradients, as Horovod's tape.
            return list(grads)
        self.specs(variables)
        missing = [g is None for g in grads]
        dense = []
        for g, v in zip(grads, variables):
            if g is None:
                g = tf.zeros(_shape(v), _dtype(v))
            elif isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
            dense.append(g)
        if tf.executing_eagerly():
            out = self.run_eager(dense)
        else:

            def host() -> List[Any]:
                got = tf.py_function(self.run_eager, dense, Tout=[g.dtype for g in dense])
                got = list(got) if isinstance(got, (list, tuple)) else [got]
                for o, g in zip(got, dense):
                    o.set_shape(g.shape)
                return got

            out = self.graph.step(dense, host)
        return [None if m else o for m, o in zip(missing, out)]

    def run_eager(self, *grads: Any) -> List[tf.Tensor]:
        """The eager step: submit in backward order, wait, reshape back."""
        if len(grads) == 1 and isinstance(grads[0], (list, tuple)):
            grads = tuple(grads[0])
        assert self.exchange is not None  # which counts the steps run in the graph first
        with self._lock:
            reduced = self.complete(lambda i: as_input(grads[self.order[i]]))
            out: List[Any] = [None] * len(grads)
            for i, pos in enumerate(self.order):
                g = grads[pos]
                out[pos] = tf.cast(tf.reshape(_read(reduced[i]), tf.shape(g)), g.dtype)
            self.step_done()
            self.graph.after_host_step()
        return out

    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals, controller states, step and plan, as NumPy."""
        return _to_numpy(super().state_dict())


#: The engines this process keeps by name: objects re-created every step
#: (tapes, compressors) with one name continue one exchange, so residuals,
#: thresholds and the plan persist (``ENGINES.named(name, options, make)``).
ENGINES: Registry[Engine] = Registry("the first DistributedGradientTape / Compression of that name")


def exchange(name: str = "dlgs.tape") -> Engine:
    """The engine (what ``tape.dlgs`` returns) this process keeps under
    ``name``: the tape's or ``Compression``'s ``name=`` (default: the tape's).

    Reaches a tape created inside a ``tf.function``, whose Python object is
    gone after tracing: ``dlgs.tensorflow.exchange().stats()``, or
    ``tf.train.Checkpoint(dlgs=dlgs.tensorflow.exchange().trackable)``. To
    resume, create one tape with the same options and name eagerly before
    restoring (``dlgs.tensorflow.DistributedGradientTape(tf.GradientTape(),
    density=...)``): the engine then exists, takes the restored state and
    applies it when the first step builds the exchange.

    Raises:
        KeyError: nothing was created under ``name`` in this process.
    """
    return ENGINES[name]


class ExchangeState(tf.train.experimental.PythonState):
    """The exchange's rank-local state as one checkpoint entry.

    ``tf.train.Checkpoint(model=model, dlgs=tape_or_opt.dlgs.trackable)``: the
    residuals (the part of this rank's gradient not sent yet), controller
    states, step and merge plan are saved as one pickled string. Save one
    checkpoint per rank to resume exactly; a state saved by another rank or at
    another world size resumes with zero residuals (docs/design.md).
    """

    def __init__(self, engine: Engine):
        self._engine = engine

    def serialize(self):
        return pickle.dumps(self._engine.state_dict(), protocol=4)

    def deserialize(self, string_value):
        raw = string_value.numpy() if hasattr(string_value, "numpy") else string_value
        self._engine.load_state_dict(pickle.loads(raw))


def _to_numpy(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_numpy(v) for v in obj)
    if isinstance(obj, (tf.Variable, tf.Tensor)) or hasattr(obj, "var"):
        return np.asarray(_read(obj).numpy())
    return obj


def _graph_name(name: str) -> str:
    """A collective's name as a graph op's: Horovod negotiates on the op's
    name after its last ``/`` (``ignore_name_scope``), and an op name allows
    letters, digits, ``_`` and ``.``; the same on every rank."""
    return "g." + re.sub(r"[^A-Za-z0-9_.]", "_", name)


def _clock():
    """Seconds after queued device work finished (profiling only)."""
    if tf.config.list_logical_devices("GPU"):

        def clock() -> float:
            tf.test.experimental.sync_devices()
            return time.perf_counter()

        return clock
    return time.perf_counter  # eager CPU ops complete before they return


class DlgsAccessors:
    """What the tape and the Keras optimizer add (both keep their
    :class:`Engine` as ``self._dlgs_engine``)."""

    @property
    def dlgs(self) -> Engine:
        """dlgs' side of this tape / optimizer: ``stats()``, ``planner``,
        ``reprofile()``, ``last_step_finite``, ``exchange``, and ``trackable``
        for ``tf.train.Checkpoint(dlgs=obj.dlgs.trackable)``
        (:class:`dlgs.core.engine.Engine`)."""
        return self._dlgs_engine
