"""``topology="hierarchical"`` behind TensorFlow's doors, on every rank under
``horovodrun -np 4`` (2 nodes of 2, ``ranks_per_node=2``); helpers from
``tf_worker.py``; ``tests/test_hierarchical.py`` asserts on the records.

Usage: ``horovodrun -np 4 --gloo python tests/parallel/tf_hier_worker.py OUT_DIR two_level``
"""

from __future__ import annotations

import os
import sys

# hvd.init() reads it: dlgs adds the node and cross-node process sets.
os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from scenarios import main, scenario  # noqa: E402  (tests/parallel, the script's own folder)
from tf_worker import dlgs_tape, flat, hvd_tape, mlp, run_loop  # noqa: E402

import dlgs.tensorflow  # noqa: E402
import dlgs.tensorflow.keras  # noqa: E402

TWO_LEVEL = dict(topology="hierarchical", ranks_per_node=2, min_sparse_size=1000)


@scenario
def two_level():
    """Each door trains 4 steps on the two-level exchange: the tape eagerly
    and in a tf.function, Keras' optimizer, Horovod's tape with
    dlgs.tensorflow.Compression; the parameters' digests after every step
    (the same on every rank), and density 1.0 against Horovod's tape."""
    steps, out = 4, {}
    forms = {"tape": (0.05, False), "tape_function": (0.05, True), "dense": (1.0, False)}
    for form, (density, function) in forms.items():
        model = mlp(3)
        wrap = dlgs_tape(density=density, name=f"h.{form}", **TWO_LEVEL)
        out[form] = run_loop(model, keras.optimizers.SGD(0.1), wrap, steps, function=function)
        out[f"{form}_exchange"] = type(dlgs.tensorflow.exchange(f"h.{form}").exchange).__name__
        if form == "dense":
            ref = mlp(3)
            run_loop(ref, keras.optimizers.SGD(0.1), hvd_tape, steps)
            out["dense_max_diff"] = float(np.abs(flat(model) - flat(ref)).max())
    model = mlp(3)
    opt = dlgs.tensorflow.keras.DistributedOptimizer(
        keras.optimizers.SGD(0.1), density=0.05, name="h.keras", **TWO_LEVEL
    )
    out["keras"] = run_loop(model, opt, lambda t, m: (t, m.trainable_variables), steps)
    model = mlp(3)
    comp = dlgs.tensorflow.Compression(
        [v.value for v in model.trainable_variables], density=0.05, name="h.c", **TWO_LEVEL
    )

    def wrap(tape, m):
        return (
            hvd.DistributedGradientTape(tape, compression=comp, num_groups=1),
            [v.value for v in m.trainable_variables],
        )

    out["compression"] = run_loop(model, keras.optimizers.SGD(0.1), wrap, steps)
    return out


if __name__ == "__main__":
    main(sys.argv, hvd)
