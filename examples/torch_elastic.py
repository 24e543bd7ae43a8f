"""Horovod Elastic with dlgs: the recipe of Horovod's elastic PyTorch example,
with ``dlgs.torch.DistributedOptimizer`` in place of ``hvd.DistributedOptimizer``.

Run it as any elastic job, for example on this machine with two one-slot
"hosts" (as Horovod's own elastic tests do)::

    printf '#!/bin/bash\\necho localhost:1\\necho 127.0.0.1:1\\n' > discover.sh
    chmod +x discover.sh
    horovodrun -np 2 --min-num-proc 1 --max-num-proc 2 --gloo \\
        --host-discovery-script ./discover.sh python examples/torch_elastic.py

What happens at a reset (docs/design.md, "Horovod Elastic"): the failed step is
dropped; ``TorchState``'s restore loads the last commit's residuals and
thresholds; the first gradient in the new world makes every rank agree on
the step and plan (a worker that joined takes the survivors'); the messages
are laid out for the new size. Use the flat exchange (the default) or
``transport="reduce"``: ``topology="hierarchical"`` is refused under Elastic.
"""

import argparse

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import dlgs.torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200, help="batches in all")
    parser.add_argument("--commit-every", type=int, default=10, help="batches per commit")
    parser.add_argument("--density", type=float, default=0.01, help="dlgs density")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    )
    lr = 0.01
    opt = dlgs.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr * hvd.size()),
        named_parameters=model.named_parameters(),
        density=args.density,
    )

    @hvd.elastic.run
    def train(state):
        while state.batch < args.batches:
            g = torch.Generator().manual_seed(1000 * state.batch + hvd.rank())
            x = torch.randn(32, 784, generator=g)
            y = torch.randint(0, 10, (32,), generator=g)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.batch += 1
            if state.batch % args.commit_every == 0:
                state.commit()
                if hvd.rank() == 0:
                    print(
                        f"batch {state.batch} of {args.batches} on {hvd.size()} ranks, "
                        f"loss {loss.item():.3f}",
                        flush=True,
                    )

    def on_reset():
        # As Horovod's recipe: the learning rate follows the world size.
        for group in opt.param_groups:
            group["lr"] = lr * hvd.size()

    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)
    state.register_reset_callbacks([on_reset])
    train(state)


if __name__ == "__main__":
    main()
