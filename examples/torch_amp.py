"""Mixed-precision training with dlgs: fp16 autocast and a dynamic loss scaler.

Runnable on CPU (fp16 autocast works there with torch >= 2.3) and unchanged on GPUs
(pass ``--device cuda``)::

    horovodrun -np 2 --gloo python examples/torch_amp.py --steps 300
    horovodrun -np 2 --gloo python examples/torch_amp.py --pattern plain

Fashion-MNIST from Debian's ``dataset-fashion-mnist`` (``make install`` installs it), read
with the repository's loader; ``--data random`` trains on random data instead (a smoke test).
The one dlgs-specific line is the optimizer; ``scaler=scaler`` lets dlgs keep what waits in
its residuals in unscaled units and complete the exchange when back-propagation ends, so
that every rank skips the same overflowing steps.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import dlgs.torch


def data(kind: str, device: torch.device):
    if kind == "random":
        g = torch.Generator().manual_seed(0)
        x, y = torch.rand(6000, 1, 28, 28, generator=g), torch.randint(0, 10, (6000,), generator=g)
        return x.to(device), y.to(device)
    # The repository's loader, importable wherever the example is launched from.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.datasets import fashion_mnist

    try:
        x, y = map(torch.from_numpy, fashion_mnist("train"))
    except FileNotFoundError as err:
        raise SystemExit(f"{err}\n(or run with --data random)") from None
    return x.to(device), y.to(device)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--pattern", choices=("horovod", "plain"), default="horovod")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--data", choices=("fashion", "random"), default="fashion")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    hvd.init()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(hvd.local_rank())
    x, y = data(args.data, device)
    if hvd.rank() == 0:
        logging.info("training on %s: %d images", args.data, len(x))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    ).to(device)
    scaler = torch.amp.GradScaler(device.type)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # The one changed line (was hvd.DistributedOptimizer(opt, named_parameters=...)).
    opt = dlgs.torch.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), density=args.density, scaler=scaler
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    skipped = 0
    for step in range(args.steps):
        idx = torch.randint(0, len(x), (64,), generator=torch.Generator().manual_seed(step))
        idx = idx[hvd.rank() :: hvd.size()].to(device)
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16):
            loss = F.cross_entropy(model(x[idx]), y[idx])
        scaler.scale(loss).backward()
        if args.pattern == "horovod":  # Horovod's documented AMP pattern
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
        else:  # the plain pattern works too with dlgs
            scaler.step(opt)
        scaler.update()
        skipped += not opt.dlgs.last_step_finite
        if step % 100 == 0 and hvd.rank() == 0:
            logging.info("step %d loss %.3f scale %g", step, loss.item(), scaler.get_scale())
    if hvd.rank() == 0:
        logging.info("done: %d steps, %d skipped by the scaler", args.steps, skipped)


if __name__ == "__main__":
    main()
