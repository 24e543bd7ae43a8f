"""Real ranks of ``transport="reduce"`` (tests/test_reduction.py):
``python reduce_worker.py OUT DENSITY [more] [dense]``. The shared MLP
(mlp_steps.py) trained 6 steps on per-rank data; each rank writes the digest
of its parameters after every step, and at density 1.0 those of stock
Horovod's optimizer on the same data; the same for form (a) (Horovod's
optimizer with ``dlgs.torch.Compression``) by the reduction. With ``more`` also: float16 on the
wire; a checkpoint after 3 steps resumed in fresh objects on every rank,
against the run going on; ranks given different widths; and
``transport="auto"`` with a plan that sends one layer by each transport.
With ``dense`` also density 1.0 against stock Horovod (``at_one``), in the
same launch."""

import io
import json
import sys

import horovod.torch as hvd
import torch
from mlp_steps import dlgs_opts, form_a_opts, horovod_opt, model_and_opt, train

import dlgs

out, density = sys.argv[1], float(sys.argv[2])
more, dense = "more" in sys.argv[3:], "dense" in sys.argv[3:]
hvd.init()
rank = hvd.rank()
torch.set_num_threads(1)
dlgs_opt = dlgs_opts(density, transport="reduce")


def resume():
    """Digests of steps 3-5: going on after a checkpoint at step 3, and
    fresh objects that loaded it (every rank its own state). Layer-wise: a
    planner's timed profile would make the two runs' plans differ."""
    make = dlgs_opts(density, transport="reduce", merge="none")
    model, opt = model_and_opt(make)
    train(model, opt, rank, steps=3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    straight, _ = train(model, opt, rank, steps=3, start=3)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    model, opt = model_and_opt(make)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    resumed, _ = train(model, opt, rank, steps=3, start=3)
    return straight, resumed


result = {"rank": rank}
model, opt = model_and_opt(dlgs_opt)
result["dlgs"], result["losses"] = train(model, opt, rank)
result["describe"] = opt.dlgs.describe()
# Form (a), Horovod's optimizer with the compressor, by the reduction.
result["form_a"], _ = train(*model_and_opt(form_a_opts(density, transport="reduce")), rank)
if density == 1.0:
    result["horovod"], _ = train(*model_and_opt(horovod_opt), rank)
if more:
    half = dlgs_opts(density, transport="reduce", value_dtype="float16")
    result["float16"], _ = train(*model_and_opt(half), rank)
    result["straight"], result["resumed"] = resume()
    # transport="auto" under a plan routing one layer by the reduction and
    # another by allgather.
    model, opt = model_and_opt(dlgs_opts(density, transport="auto", merge="none"))
    ex = opt.dlgs.exchange
    ex.set_plan([([ex.index("0.weight")], "reduce"), ([ex.index("2.weight")], "allgather")])
    result["routed"], _ = train(model, opt, rank)
    result["routes"] = list(ex.transport.routes)
    try:
        model_and_opt(dlgs_opts(density, transport="reduce", reduce_width=1.0 + rank))
        result["mismatch"] = None
    except dlgs.RankMismatchError as err:
        result["mismatch"] = str(err)
if dense:
    model, opt = model_and_opt(dlgs_opts(1.0, transport="reduce"))
    result["at_one"] = {
        "dlgs": train(model, opt, rank)[0],
        "form_a": train(*model_and_opt(form_a_opts(1.0, transport="reduce")), rank)[0],
        "horovod": train(*model_and_opt(horovod_opt), rank)[0],
    }
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(result, f)
