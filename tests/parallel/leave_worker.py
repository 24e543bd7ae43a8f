"""Real ranks, one of which leaves the job on its own (tests/test_faults.py):
``python leave_worker.py OUT HOW TOPOLOGY DOOR``.

A small MLP trained with ``DOOR`` (``a``: Horovod's optimizer with
``dlgs.torch.Compression``; ``b``: ``dlgs.torch.DistributedOptimizer``;
``tf``: ``dlgs.tensorflow.DistributedGradientTape``) on ``TOPOLOGY``
(``flat`` | ``hierarchical``, 2 ranks per node). Rank 1, at step 3:

- ``exit1`` / ``exit0``: ``sys.exit(1)`` / ``sys.exit(0)``, as a script that
  catches an error and exits with a status;
- ``return``: leaves the loop and ends normally, as a rank whose data loader
  gives it fewer batches;
- ``os_exit``: ``os._exit(3)``;
- ``sigterm``: a SIGTERM to itself (Python's default: the process ends);
- ``resync``: calls ``.dlgs.resync()`` alone (the others do not).

The other ranks train on (30 steps). Nothing here catches anything: every
rank must end within seconds (the test reads when). Each rank writes
``OUT/exit{rank}.json`` at its last exit handler (registered before
Horovod's, so it runs after Horovod shut down) and rank 1 ``OUT/fault.json``
with the time it left; every rank that fails writes ``OUT/error{rank}.txt``
with its error and the notes on it.
"""

import json
import os
import signal
import sys
import time
import traceback

import exit_record  # before Horovod: its handler runs after Horovod's shutdown

out, how, topology, door = sys.argv[1:5]

if door == "tf":
    import horovod.tensorflow as hvd
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
else:
    import horovod.torch as hvd
    import torch

    torch.set_num_threads(1)

import dlgs.core.state.resume  # noqa: E402

# The agreement resync() asks for waits this long for the others here (the
# default is a minute, for ranks that arrive late on a real job).
dlgs.core.state.resume.RESYNC_WAIT_SECONDS = 3.0

hvd.init(process_sets="dynamic")
rank = hvd.rank()
exit_record.set_rank(out, rank)
options = {"merge": "none", "density": 0.05, "min_sparse_size": 1000}
if topology == "hierarchical":
    options.update(topology="hierarchical", ranks_per_node=2)


def torch_door():
    from mlp_steps import dlgs_opts, form_a_opts, model_and_opt, train

    make = form_a_opts if door == "a" else dlgs_opts
    density = options.pop("density")
    options.pop("min_sparse_size")
    model, opt = model_and_opt(make(density, **options))

    def step(s):
        train(model, opt, rank, steps=1, start=s)

    return step, opt


def tf_door():
    import keras
    import numpy as np
    import tensorflow as tf

    import dlgs.tensorflow

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(96, activation="relu", name="d0"),
            keras.layers.Dense(40, activation="relu", name="d1"),
            keras.layers.Dense(10, name="d2"),
        ]
    )
    hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
    sgd = keras.optimizers.SGD(0.05)
    holder = {}

    def step(s):
        rng = np.random.default_rng(100 * s + rank)
        x = rng.standard_normal((16, 32)).astype("float32")
        y = rng.integers(0, 10, 16)
        with tf.GradientTape() as t:
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True)
            )
        tape = dlgs.tensorflow.DistributedGradientTape(t, name="leave", **options)
        grads = tape.gradient(loss, model.trainable_variables)
        sgd.apply(grads, model.trainable_variables)
        holder["tape"] = tape

    return step, holder


step, handle = tf_door() if door == "tf" else torch_door()
try:
    for s in range(30):
        if rank == 1 and s == 3:
            with open(f"{out}/fault.json", "w") as f:
                json.dump({"time": time.time(), "rank": rank}, f)
            if how == "exit1":
                sys.exit(1)
            if how == "exit0":
                sys.exit(0)
            if how == "return":
                break
            if how == "os_exit":
                os._exit(3)
            if how == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)  # the signal ends the process first
            if how == "resync":
                (handle["tape"] if door == "tf" else handle).dlgs.resync()
        step(s)
except Exception as err:
    notes = "\n".join(getattr(err, "__notes__", []))
    with open(f"{out}/error{rank}.txt", "w") as f:
        f.write(f"{type(err).__name__}: {err}\n{notes}\n{traceback.format_exc()}")
    raise
