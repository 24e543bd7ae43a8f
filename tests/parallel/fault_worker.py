"""Real ranks with a fault on one of them (tests/test_faults.py):
``python fault_worker.py OUT FAULT TOPOLOGY TRANSPORT``.

The shared MLP (mlp_steps.py) trained with form (b) on ``TOPOLOGY``
(``flat`` | ``hierarchical``, 2 ranks per node) and ``TRANSPORT``
(``allgather`` | ``reduce``), with one fault:

- ``step``: rank 1 raises at step 3;
- ``stuck-exit``: as ``step``, and rank 1's exit is held up after dlgs's
  exit handler (a handler that sleeps a minute, as a Horovod shutdown held in
  a Gloo operation would): dlgs must end the process itself;
- ``construct``: rank 0 raises right after the optimizer is built;
- ``load``: rank 0 loads a damaged checkpoint (NaN residuals and thresholds)
  in Horovod's resume recipe, which dlgs refuses;
- ``form-a-set``: Horovod's ``test_optimizer_process_sets`` in form (a): the
  optimizer on the process set of the even ranks, the compressor not told.

Nothing here catches the fault: the job must end on every rank (the test
reads when). Each rank writes ``OUT/exit{rank}.json`` with the time its
interpreter reached its last exit handler (registered before Horovod's, so it
runs after Horovod shut down), and the faulting rank ``OUT/fault.json`` with
the time of the fault.
"""

import atexit
import json
import sys
import time

import exit_record  # before Horovod: its handler runs after Horovod's shutdown

out, fault, topology, transport = sys.argv[1:5]

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
from mlp_steps import dlgs_opts, model_and_opt, train  # noqa: E402

hvd.init(process_sets="dynamic")
rank = hvd.rank()
exit_record.set_rank(out, rank)
torch.set_num_threads(1)
if fault == "stuck-exit" and rank == 1:
    # Registered after Horovod's handler and before dlgs's (added with the
    # optimizer), it runs after dlgs's and before Horovod's shutdown: exit
    # handlers run last-registered first.
    atexit.register(time.sleep, 60)
options = {"merge": "none", "transport": transport}
if topology == "hierarchical":
    options.update(topology="hierarchical", ranks_per_node=2)


def injected(message):
    with open(f"{out}/fault.json", "w") as f:
        json.dump({"time": time.time(), "rank": rank}, f)
    return RuntimeError(message)


def damaged(state):
    """``state`` with every floating tensor set to NaN."""
    if isinstance(state, dict):
        return {k: damaged(v) for k, v in state.items()}
    if isinstance(state, list):
        return [damaged(v) for v in state]
    if torch.is_tensor(state) and state.is_floating_point():
        return torch.full_like(state, float("nan"))
    if isinstance(state, float):
        return float("nan")
    return state


if fault == "form-a-set":
    import dlgs.torch

    even = hvd.add_process_set([r for r in range(hvd.size()) if r % 2 == 0])
    model, _ = model_and_opt(lambda sgd, model: sgd)
    compression = dlgs.torch.Compression(model.named_parameters(), density=0.05)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=compression,
        process_set=even,
    )
    if rank == 0:  # the rank that refuses (one writer: both would race on the file)
        with open(f"{out}/fault.json", "w") as f:
            json.dump({"time": time.time(), "rank": rank}, f)
    train(model, opt, rank, steps=2)  # rank 0 refuses at its first gradient
    sys.exit(0)
if fault == "load":
    model, opt = model_and_opt(dlgs_opts(0.05, **options))
    train(model, opt, rank, steps=3)
    saved = damaged(opt.state_dict()["dlgs"])
    state = opt.state_dict()
    state["dlgs"] = saved
model, opt = model_and_opt(dlgs_opts(0.05, **options))
if fault == "construct" and rank == 0:
    raise injected("injected fault right after construction")
if fault == "load" and rank == 0:
    with open(f"{out}/fault.json", "w") as f:
        json.dump({"time": time.time(), "rank": rank}, f)
    opt.load_state_dict(state)  # refused: NaN in the checkpoint
    raise AssertionError("a damaged checkpoint loaded")
for step in range(8):
    if fault in ("step", "stuck-exit") and rank == 1 and step == 3:
        raise injected("injected fault at step 3")
    train(model, opt, rank, steps=1, start=step)
