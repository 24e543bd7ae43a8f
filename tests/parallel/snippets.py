"""Runs the docs' code snippets on every rank under ``horovodrun -np 2``.

``tests/test_docs.py`` extracts each fenced ``python`` block of the user docs that
is marked ``<!-- test: HARNESS -->`` and writes them to a JSON file; this script
runs them, in order, each in a fresh namespace: the harness's prelude (the names a
reader's script would already have: ``model``, ``opt``, ``loss``, ``tape``, data),
the snippet itself (compiled under the doc's file name and line numbers, so a
failure points into the doc), then the harness's training steps. It records per
snippet whether it ran, a digest of the model's parameters (ranks must agree),
whether training changed them, and the step count of every dlgs exchange it made.

Usage: ``horovodrun -np 2 --gloo python tests/parallel/snippets.py SNIPPETS_JSON OUT_DIR``
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np

TORCH_PRELUDE = """
import torch, horovod.torch as hvd, dlgs.torch
hvd.init()
torch.set_num_threads(1)

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

    def forward(self, x):
        return self.body(x)

loss_fn = torch.nn.functional.cross_entropy
_g = torch.Generator().manual_seed(1 + hvd.rank())
_x, _y = torch.randn(32, 64, generator=_g), torch.randint(0, 10, (32,), generator=_g)
loader = [(_x[i:i + 8], _y[i:i + 8]) for i in range(0, 32, 8)]
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
"""

# Training steps after a fragment; with a ``scaler`` in the namespace, the AMP pattern.
TORCH_TRAIN = """
def _train(steps=3):
    for _ in range(steps):
        for xb, yb in loader:
            opt.zero_grad()
            out = loss_fn(model(xb), yb)
            if "scaler" in globals():
                scaler.scale(out).backward()
                scaler.step(opt)
                scaler.update()
            else:
                out.backward()
                opt.step()
"""

TF_PRELUDE = """
import tensorflow as tf, keras, horovod.tensorflow as hvd, dlgs.tensorflow, dlgs.tensorflow.keras
hvd.init()
keras.mixed_precision.set_global_policy("float32")   # a snippet may have changed it

def make_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                             keras.layers.Dense(10)])

loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
_rng = np.random.default_rng(1 + hvd.rank())
x = _rng.standard_normal((32, 64)).astype("float32")
y = _rng.integers(0, 10, 32)
x_shard, y_shard = x, y
model = make_model()
"""

TF_TAPE = """
with tf.GradientTape() as tape:
    loss = loss_fn(y, model(x, training=True))
"""

# name: (prelude, code run after the snippet, the snippet runs once per step).
HARNESSES = {
    # A fragment that builds ``opt`` from a torch optimizer (``loss`` is one batch's loss,
    # for the mixed-precision fragment); then 3 epochs of 4 steps.
    "torch": (TORCH_PRELUDE + TORCH_TRAIN + "loss = loss_fn(model(_x), _y)\n", "_train()", False),
    # A whole script given Net, loader and loss_fn.
    "torch-script": (TORCH_PRELUDE, "", False),
    # A fragment run after training with a dlgs optimizer (checkpoints).
    "torch-trained": (
        TORCH_PRELUDE
        + TORCH_TRAIN
        + "opt = dlgs.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters(),"
        " density=0.01)\n_train()\n",
        "",
        False,
    ),
    # A fragment that turns ``tape`` into gradients ``grads``, run for 3 steps (a fresh
    # tape each step), the gradients applied by plain SGD.
    "tf-tape": (TF_PRELUDE + "_sgd = keras.optimizers.SGD(0.05)\n", "", True),
    # A fragment that compiles ``model``; then one epoch of ``fit``.
    "tf-fit": (
        TF_PRELUDE,
        "model.fit(x_shard, y_shard, batch_size=8, epochs=1, verbose=0)",
        False,
    ),
    # A fragment run after one epoch of fit with a dlgs optimizer ``opt`` (checkpoints).
    "tf-trained": (
        TF_PRELUDE + "opt = dlgs.tensorflow.keras.DistributedOptimizer(\n"
        "    keras.optimizers.SGD(0.05), density=0.01)\n"
        "model.compile(optimizer=opt, loss=loss_fn, jit_compile=False)\n"
        "model.fit(x_shard, y_shard, batch_size=8, epochs=1, verbose=0)\n",
        "",
        False,
    ),
    # A whole script given make_model, loss_fn and data; ``train_step`` run 3 times if defined.
    "tf-script": (
        TF_PRELUDE,
        "if 'train_step' in globals():\n    for _ in range(3):\n        train_step(x, y)",
        False,
    ),
}


def _params(ns):
    model = ns["model"]
    if hasattr(model, "parameters"):
        return [p.detach().cpu().contiguous().numpy() for p in model.parameters()]
    return [np.asarray(v.numpy()) for v in model.trainable_variables]


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _exchange_steps(ns):
    """Steps run by every dlgs exchange reachable from the namespace's objects."""
    steps = {}
    for name, obj in ns.items():
        engine = getattr(obj, "dlgs", None) if not name.startswith("_") else None
        if engine is not None and hasattr(engine, "exchange"):
            steps[name] = engine.exchange.step if engine.exchange is not None else 0
    return steps


def run_one(snippet) -> dict:
    prelude, after, per_step = HARNESSES[snippet["harness"]]
    if snippet["harness"].startswith("tf"):
        # Each snippet is its own script: tapes and compressors it names afresh
        # (the default names included) start new exchanges, as in a new process.
        from dlgs.tensorflow import _engine

        _engine.ENGINES.clear()  # the registry a new process starts with
    ns = {"__name__": "__snippet__", "np": np}
    exec(compile(prelude, f"<{snippet['harness']} prelude>", "exec"), ns)
    before = _digest(_params(ns))
    # Blank lines first, so that tracebacks give the doc's own line numbers.
    code = compile("\n" * snippet["line"] + snippet["code"], snippet["doc"], "exec")
    steps = 3 if per_step else 1
    for _ in range(steps):
        if per_step:
            exec(TF_TAPE, ns)
        exec(code, ns)
        if per_step:
            ns["_sgd"].apply(ns["grads"], ns["model"].trainable_variables)
    if after:
        exec(compile(after, f"<{snippet['harness']} steps>", "exec"), ns)
    after_params = _params(ns)
    return {
        "digest": _digest(after_params),
        "changed": _digest(after_params) != before,
        "exchange_steps": _exchange_steps(ns),
    }


def main() -> None:
    snippets = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    framework = snippets[0]["harness"].split("-")[0] if snippets else "torch"
    if framework == "tf":
        import horovod.tensorflow as hvd
    else:
        import horovod.torch as hvd
    hvd.init()
    rank = hvd.rank()
    results = {}
    # Each rank works in its own folder (checkpoint snippets write files).
    work = Path(tempfile.mkdtemp(prefix=f"snippets-rank{rank}-"))
    os.chdir(work)
    for snippet in snippets:
        key = f"{snippet['doc']}:{snippet['line']}"
        try:
            results[key] = {"ok": True, **run_one(snippet)}
        except Exception:  # recorded, and the test fails with this traceback
            results[key] = {"ok": False, "error": traceback.format_exc()}
        results[key]["files"] = sorted(os.listdir(work))
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
