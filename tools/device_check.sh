#!/usr/bin/env bash
# The GPU check as one command, for a session lent a device (docs/gpus.md, "The
# self-check"). There: torch with CUDA, numpy, no Horovod, no network. With the
# device tool: run `bash tools/device_check.sh` with timeout_s 480 (it stops its
# own parts in time), then commit what comes back from $OUT under
# benchmarks/results/selfcheck-cuda-<date>/ and write "What has run on a GPU".
set -uo pipefail
out="${OUT:-/tmp/dlgs-device-check}"
device="${DLGS_DEVICE:-cuda}"  # DLGS_DEVICE=cpu: a dry run of this script here
mkdir -p "$out"
{
  nvidia-smi -L || true
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
} > "$out/device.txt" 2>&1
# The self-check first: the result that matters (bit-identical ranks, host syncs,
# launches, determinism, timings). Exit status 1 when a check fails.
timeout 330 python -m dlgs.selfcheck --device "$device" --out "$out/selfcheck"
rc=$?
echo "selfcheck exit status $rc" >> "$out/device.txt"
# Selection speed against torch.topk and a single pass (optional: best effort).
timeout 100 python -m benchmarks.kernels --device "$device" --sizes 1e6,1e7,2.5e7,1e8 \
  --out "$out/kernels" >> "$out/device.txt" 2>&1 || echo "kernels benchmark did not finish" >> "$out/device.txt"
exit $rc
