"""Real ranks of ``topology="hierarchical"`` (tests/test_hierarchical.py):
``python hier_worker.py OUT DENSITY [plain|auto]``. Four ranks as 2 nodes of 2
(``ranks_per_node=2``); the shared MLP (mlp_steps.py) trained 6 steps on
per-rank data; each rank writes the digest of its parameters after every
step, and at density 1.0 those of stock Horovod's optimizer on the same data.
``plain``: Horovod started without dynamic process sets (the error must say
what to add); ``auto``: ``topology="auto"`` (timed; either exchange may be
chosen); ``reduce``: the sparse reduction between nodes (``transport="reduce"``,
issue 44), in both forms. By default a first two-level exchange is built and trained before
the one recorded: Horovod form (a) (``dlgs.torch.Compression(topology=
"hierarchical")`` in stock Horovod's optimizer), whose digests are recorded
too; the optimizer after it reuses its process sets."""

import json
import sys

import horovod.torch as hvd
import torch
from mlp_steps import dlgs_opts, horovod_opt, model_and_opt, train

import dlgs.torch

out, density = sys.argv[1], float(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else ""
plain = mode == "plain"
hvd.init() if plain else hvd.init(process_sets="dynamic")
rank = hvd.rank()
torch.set_num_threads(1)


transport = "reduce" if mode == "reduce" else "allgather"
dlgs_opt = dlgs_opts(
    density,
    merge="none",
    topology="auto" if mode == "auto" else "hierarchical",
    ranks_per_node=2,
    transport=transport,
)


def form_a(sgd, model):
    """Form (a): stock Horovod's optimizer, dlgs' two-level exchange as its compression."""
    compression = dlgs.torch.Compression(
        model.named_parameters(),
        density=density,
        min_sparse_size=1000,
        merge="none",
        topology="hierarchical",
        ranks_per_node=2,
        transport=transport,
    )
    opt = hvd.DistributedOptimizer(
        sgd, named_parameters=model.named_parameters(), compression=compression
    )
    result["form_a_describe"] = compression.attach(opt).dlgs.describe
    return opt


result = {"rank": rank}
try:
    if mode in ("", "reduce"):
        # A two-level exchange built before (another model, or the same one
        # again, here through form (a)): the next one reuses its process sets
        # (Horovod refuses to add a set twice).
        result["form_a"], _ = train(*model_and_opt(form_a), rank)
        result["form_a_describe"] = result["form_a_describe"]()
    model, opt = model_and_opt(dlgs_opt)
    result["dlgs"], result["losses"] = train(model, opt, rank)
    result["describe"] = opt.dlgs.describe()
    if density == 1.0:
        result["horovod"], _ = train(*model_and_opt(horovod_opt), rank)
except ValueError as err:
    result["error"] = str(err)
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(result, f)
