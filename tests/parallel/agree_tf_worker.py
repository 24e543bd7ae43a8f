"""Rank agreement and process sets for TensorFlow, on every rank under ``horovodrun -np 2``.

The TensorFlow counterpart of ``agree_worker.py`` (helpers from
``tf_worker.py``); ``tests/test_agreement.py`` asserts on the records.

Usage: ``horovodrun -np 2 --gloo python tests/parallel/agree_tf_worker.py OUT_DIR SCENARIO...``
"""

from __future__ import annotations

import os
import sys

# hvd.init() reads it: process sets can be added after initialisation.
os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from scenarios import main, scenario  # noqa: E402  (tests/parallel, the script's own folder)
from tf_worker import batch, digest, dlgs_tape, flat, loss_fn, mlp, run_loop  # noqa: E402

import dlgs.tensorflow  # noqa: E402
from dlgs.core import RankMismatchError  # noqa: E402

CASES = {
    "bucket_elements": dict(merge="buckets", bucket_elements=(1024, 2048)),
    "drift_window": dict(drift_window=(50, 8)),
    "max_group": dict(max_group=(None, 2)),
    "gradient_predivide_factor": dict(gradient_predivide_factor=(1.0, 2.0)),
    "op": dict(op=(hvd.Average, hvd.Sum)),
    "compression": dict(compression=(hvd.Compression.none, hvd.Compression.fp16)),
}


@scenario
def tf_option_mismatch():
    """Options different on the two ranks: RankMismatchError at the first gradient()."""
    import tensorflow as tf

    out = {}
    x, y = batch(0)
    for case, pairs in CASES.items():
        model = mlp(6, broadcast=False)
        kw = {k: v[hvd.rank()] if isinstance(v, tuple) else v for k, v in pairs.items()}
        try:
            with tf.GradientTape() as t:
                loss = loss_fn(model, x, y)
            dlgs.tensorflow.DistributedGradientTape(t, name=f"mm.{case}", **kw).gradient(
                loss, model.trainable_variables
            )
            out[case] = None
        except RankMismatchError as err:
            out[case] = str(err)
    return out


@scenario
def tf_process_sets():
    """Sets [0] and [1], each rank training its own copy; then set [0] with rank 1
    outside; then the global set: every step finishes and the ranks meet again."""
    sets = [hvd.add_process_set([0]), hvd.add_process_set([1])]
    opts = dict(density=0.05, min_sparse_size=64, profile_steps=2, drift_window=3)
    out = {}
    model = mlp(4, broadcast=False)
    wrap = dlgs_tape(process_set=sets[hvd.rank()], name="ps.split", **opts)
    out["split"] = {
        "digests": run_loop(model, keras.optimizers.SGD(0.05), wrap, 12),
        "finite": bool(np.isfinite(flat(model)).all()),
    }
    model = mlp(4, broadcast=False)
    wrap = dlgs_tape(process_set=sets[0], name="ps.outside", **opts)
    out["outside"] = {"digests": run_loop(model, keras.optimizers.SGD(0.05), wrap, 8)}
    model = mlp(4)
    wrap = dlgs_tape(name="ps.global", **opts)
    out["global"] = {"digests": run_loop(model, keras.optimizers.SGD(0.05), wrap, 8)}
    out["final"] = digest(model)
    return out


if __name__ == "__main__":
    main(sys.argv, hvd)
