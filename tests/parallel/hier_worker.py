"""Real ranks of ``topology="hierarchical"`` (tests/test_hierarchical.py):
``python hier_worker.py OUT CASE...``, each case in turn in one launch. Four
ranks as 2 nodes of 2 (``ranks_per_node=2``); the shared MLP (mlp_steps.py)
trained 6 steps on per-rank data; each rank writes, per case, the digest of
its parameters after every step (``OUT/rank{r}.json``).

Cases: ``train``: density 0.05 with the allgather between nodes, after a first
two-level exchange built and trained through Horovod form (a)
(``dlgs.torch.Compression(topology="hierarchical")`` in stock Horovod's
optimizer), whose digests are recorded too; the optimizer after it reuses its
process sets. ``reduce``: the same with the sparse reduction between nodes
(``transport="reduce"``). ``dense``: density 1.0, and stock Horovod's
optimizer on the same data. ``auto``: ``topology="auto"`` (timed; either
exchange may be chosen). ``plain``: Horovod started without dynamic process
sets (the error must say what to add); it runs alone."""

import json
import sys

import horovod.torch as hvd
import torch
from mlp_steps import dlgs_opts, horovod_opt, model_and_opt, train

import dlgs.torch

out, cases = sys.argv[1], sys.argv[2:]
plain = cases == ["plain"]
hvd.init() if plain else hvd.init(process_sets="dynamic")
rank = hvd.rank()
torch.set_num_threads(1)


def form_a(density, transport, result):
    """Form (a): stock Horovod's optimizer, dlgs' two-level exchange as its compression."""

    def make(sgd, model):
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

    return make


def run(case):
    density = 1.0 if case == "dense" else 0.05
    transport = "reduce" if case == "reduce" else "allgather"
    result = {}
    try:
        if case in ("train", "reduce"):
            # A two-level exchange built before (another model, or the same one
            # again, here through form (a)): the next one reuses its process sets
            # (Horovod refuses to add a set twice).
            result["form_a"], _ = train(*model_and_opt(form_a(density, transport, result)), rank)
            result["form_a_describe"] = result["form_a_describe"]()
        make = dlgs_opts(
            density,
            merge="none",
            topology="auto" if case == "auto" else "hierarchical",
            ranks_per_node=2,
            transport=transport,
        )
        model, opt = model_and_opt(make)
        result["dlgs"], result["losses"] = train(model, opt, rank)
        result["describe"] = opt.dlgs.describe()
        if density == 1.0:
            result["horovod"], _ = train(*model_and_opt(horovod_opt), rank)
    except ValueError as err:
        result["error"] = str(err)
    return result


results = {"rank": rank, **{case: run(case) for case in cases}}
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(results, f)
