#!/usr/bin/env bash
# Installs everything dlgs needs into ./.venv: system MPI and data (when root),
# the pinned torch / TensorFlow, Horovod 0.28.1 (prebuilt wheel when one matches
# the pins, else built from the PyPI sdist with the C++17 change), and dlgs itself.
# Idempotent: a second run checks a stamp and `horovodrun --check-build` and exits.
#
# Environment:
#   DLGS_VENV         virtual environment to create/use (default: .venv)
#   DLGS_WHEELS_DIR   extra directory searched for a horovod-0.28.1 wheel
#                     (../shared/wheels is always searched)
#   DLGS_FORCE_BUILD  1 = ignore prebuilt wheels and build Horovod from the sdist
#   DLGS_QUICK_CHECK  1 = where the stamp matches, exit without `horovodrun --check-build`
#   DLGS_CUDA         auto (default) | 1 | 0. When on, installs PyPI's CUDA build of the
#                     pinned torch and builds Horovod from the sdist with
#                     HOROVOD_GPU_OPERATIONS=NCCL (NCCL from torch's nvidia-nccl wheel unless
#                     HOROVOD_NCCL_HOME/_INCLUDE/_LIB say otherwise; nvcc from
#                     HOROVOD_CUDA_HOME, else /usr/local/cuda, else PATH). auto = on when
#                     `nvidia-smi -L` lists a GPU. docs/gpus.md has the details.
#   DLGS_TORCH_INDEX  CUDA mode only: an index URL for torch (e.g. pytorch.org's cu126 index)
#                     when the driver cannot run PyPI's default CUDA build.
#   HOROVOD_BUILD_CUDA_CC_LIST  CUDA mode: compute capabilities to compile Horovod's
#                     kernels for (e.g. 80,90); default: every one nvcc supports (slow).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${DLGS_VENV:-.venv}
PY=python3
log() { printf '[install] %s\n' "$*" >&2; }

case "${DLGS_CUDA:-auto}" in
  1) CUDA=1 ;;
  0) CUDA=0 ;;
  auto) if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then CUDA=1; else CUDA=0; fi ;;
  *) log "DLGS_CUDA must be auto, 1 or 0, got '${DLGS_CUDA}'"; exit 2 ;;
esac
# Horovod compiles every framework with the same GPU flags, and its TensorFlow ops
# then need TensorFlow's GPU kernels: against the pinned tensorflow-cpu the library
# builds but does not load (undefined tensorflow::functor::DenseUpdate<GpuDevice>).
# So in CUDA mode TensorFlow is built (and checked) only beside a CUDA build of it.
WITH_TF=1
decide_tf() {
  WITH_TF=1
  if [ "$CUDA" = 1 ] && ! "$VENV/bin/python" -c \
      'import sys, tensorflow as tf; sys.exit(not tf.test.is_built_with_cuda())' 2>/dev/null; then
    WITH_TF=0
  fi
}

pin() { sed -n "s/^$1==\(.*\)$/\1/p" constraints.txt; }
# The pins pip installs against: in CUDA mode without Triton's (torch's CUDA
# build requires the Triton it was built with).
CONSTRAINTS=constraints.txt
if [ "$CUDA" = 1 ]; then
  mkdir -p "$VENV"
  CONSTRAINTS="$VENV/constraints-cuda.txt"
  grep -v '^triton==' constraints.txt >"$CONSTRAINTS"
fi
HVD_VERSION=$(pin horovod)

stamp_key() {
  { cat constraints.txt tools/install.sh setup.py; echo "cuda=$CUDA"; } | sha256sum | cut -d' ' -f1
}

check_build() {
  local out
  out=$("$VENV/bin/horovodrun" --check-build 2>&1) || { echo "$out" >&2; return 1; }
  local ok=0 wants=("\[X\] PyTorch")
  [ "$WITH_TF" = 1 ] && wants+=("\[X\] TensorFlow")
  for want in "${wants[@]}"; do
    grep -q "$want" <<<"$out" || { log "horovodrun --check-build: missing ${want#\\[X\\] }"; ok=1; }
  done
  # Controllers and tensor operations: both sections must list MPI and Gloo.
  if [ "$(grep -c '\[X\] MPI' <<<"$out")" -lt 2 ]; then log "horovodrun --check-build: MPI missing"; ok=1; fi
  if [ "$(grep -c '\[X\] Gloo' <<<"$out")" -lt 2 ]; then log "horovodrun --check-build: Gloo missing"; ok=1; fi
  if [ "$CUDA" = 1 ] && ! grep -q '\[X\] NCCL' <<<"$out"; then log "horovodrun --check-build: NCCL missing"; ok=1; fi
  [ $ok -eq 0 ] || { echo "$out" >&2; return 1; }
  log "horovodrun --check-build: PyTorch,$([ "$WITH_TF" = 1 ] && echo ' TensorFlow,') MPI and Gloo$([ "$CUDA" = 1 ] && echo ' and NCCL') present"
}

if [ -f "$VENV/.dlgs-stamp" ] && [ "$(cat "$VENV/.dlgs-stamp")" = "$(stamp_key)" ]; then
  # DLGS_QUICK_CHECK=1 (make test-fast): the stamp is enough, no build check (40 s here).
  if [ "${DLGS_QUICK_CHECK:-0}" = 1 ]; then log "already installed ($VENV; build not checked)"; exit 0; fi
  decide_tf
  if check_build; then log "already installed ($VENV)"; exit 0; fi
  log "stamp present but check failed; reinstalling"
fi

# 1. System packages (Debian), only when root and missing.
need=()
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
[ -f /usr/include/x86_64-linux-gnu/openmpi/mpi.h ] || [ -n "$(ls /usr/lib/*/openmpi/include/mpi.h 2>/dev/null)" ] || need+=(libopenmpi-dev)
[ -d /usr/share/datasets/fashion-mnist ] || need+=(dataset-fashion-mnist)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v tc >/dev/null 2>&1 || need+=(iproute2)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    log "apt-get install ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    log "not root: please install ${need[*]} (Debian) yourself"
  fi
fi

# 2. The virtual environment and pinned frameworks.
[ -x "$VENV/bin/python" ] || { log "creating $VENV"; $PY -m venv "$VENV"; }
VPY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
log "installing pinned torch / tensorflow-cpu / numpy"
"$VPY" -m pip install -q --upgrade pip wheel setuptools
if [ "$CUDA" = 1 ]; then
  # PyPI's torch for Linux x86_64 is a CUDA build. A site's pip configuration may point
  # find-links at a CPU-only wheel of the same version ('+cpu' sorts higher, so pip would
  # take it): that configuration is left out for this one install.
  log "CUDA mode: installing a CUDA build of torch"
  env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
    "$VPY" -m pip install -q -c "$CONSTRAINTS" ${DLGS_TORCH_INDEX:+--index-url "$DLGS_TORCH_INDEX"} torch
  "$VPY" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' || {
    log "CUDA mode: the installed torch is a CPU build; set DLGS_TORCH_INDEX to a CUDA index"; exit 1; }
fi
"$VPY" -m pip install -q -c "$CONSTRAINTS" torch tensorflow-cpu numpy

decide_tf

# 3. Horovod: a matching prebuilt wheel, else the sdist with C++17.
if ! "$VPY" -c "import horovod, sys; sys.exit(horovod.__version__ != '$HVD_VERSION')" 2>/dev/null; then
  pytag=$("$VPY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  wheel=""
  if [ "${DLGS_FORCE_BUILD:-0}" != 1 ]; then
    for d in ${DLGS_WHEELS_DIR:-} "$ROOT/../shared/wheels"; do
      [ -d "$d" ] || continue
      for w in "$d"/horovod-"$HVD_VERSION"-"$pytag"-"$pytag"-linux_"$(uname -m)".whl; do
        [ -f "$w" ] && { wheel=$w; break 2; }
      done
    done
  fi
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
         HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 MAKEFLAGS=${MAKEFLAGS:--j2}
  if [ "$CUDA" = 1 ]; then
    wheel=""  # the prebuilt wheels are CPU-only
    cuda_home=${HOROVOD_CUDA_HOME:-}
    [ -n "$cuda_home" ] || { [ -x /usr/local/cuda/bin/nvcc ] && cuda_home=/usr/local/cuda; } || true
    [ -n "$cuda_home" ] || { command -v nvcc >/dev/null && cuda_home=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); } || true
    [ -n "$cuda_home" ] || { log "CUDA mode: no nvcc found; set HOROVOD_CUDA_HOME"; exit 1; }
    if [ -z "${HOROVOD_NCCL_HOME:-}${HOROVOD_NCCL_INCLUDE:-}" ]; then
      # torch's own NCCL wheel ships include/ and lib/libnccl.so.2; CMake looks for libnccl.so.
      nccl=$("$VPY" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null) || {
        log "CUDA mode: torch brought no nvidia-nccl wheel; set HOROVOD_NCCL_HOME"; exit 1; }
      ln -sf libnccl.so.2 "$nccl/lib/libnccl.so"
      export HOROVOD_NCCL_INCLUDE="$nccl/include" HOROVOD_NCCL_LIB="$nccl/lib" HOROVOD_NCCL_LINK=SHARED
    fi
    # CUDA_HOME too: torch's cpp_extension, which Horovod's CMake asks for the CUDA
    # library paths, otherwise guesses it from the first nvcc on PATH.
    export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_CUDA_HOME="$cuda_home" CUDA_HOME="$cuda_home"
    if [ "$WITH_TF" = 0 ]; then
      log "CUDA mode: tensorflow is a CPU build; Horovod is built for PyTorch only"
      unset HOROVOD_WITH_TENSORFLOW
      export HOROVOD_WITHOUT_TENSORFLOW=1
    fi
    log "CUDA mode: Horovod with NCCL (CUDA at $cuda_home, NCCL at ${HOROVOD_NCCL_HOME:-${HOROVOD_NCCL_INCLUDE%/include}})"
  fi
  if [ -n "$wheel" ]; then
    log "installing prebuilt $wheel"
    "$VPY" -m pip install -q --no-deps "$wheel"
    "$VPY" -m pip install -q -c "$CONSTRAINTS" cloudpickle psutil pyyaml packaging cffi
  else
    log "building Horovod $HVD_VERSION from the PyPI sdist (about 5 minutes on 2 cores)"
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    "$VPY" -m pip download -q --no-deps --no-binary :all: -d "$tmp" "horovod==$HVD_VERSION"
    tar -xzf "$tmp"/horovod-"$HVD_VERSION".tar.gz -C "$tmp"
    src="$tmp/horovod-$HVD_VERSION"
    # PyTorch >= 2.1 needs C++17; both files must change or the link fails (DESIGN.md §2).
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
      "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt"
    CMAKE_POLICY_VERSION_MINIMUM=3.5 "$VPY" -m pip install -q --no-build-isolation -c "$CONSTRAINTS" "$src"
  fi
fi

# 4. dlgs itself with test and benchmark extras.
log "installing dlgs (editable) with dev and benchmark extras"
"$VPY" -m pip install -q -c "$CONSTRAINTS" -e ".[torch,tensorflow,benchmarks,dev]"

# 5. Triton for the tests, in a directory of its own ($VENV/triton), not on the venv's
# path: torch imports Triton whenever it finds it (torch._dynamo, at an optimizer's
# construction), and Triton's library beside TensorFlow's in one process crashes it.
# The tests that run Triton's CPU interpreter add it to their child processes' path.
# In CUDA mode torch's own Triton is on the path already.
if [ "$CUDA" = 0 ] && [ "$(uname -m)" = x86_64 ] && [ "$(uname -s)" = Linux ]; then
  if [ ! -d "$VENV/triton/triton" ]; then
    log "installing Triton (tests only) into $VENV/triton"
    "$VPY" -m pip install -q --no-deps -c "$CONSTRAINTS" --target "$VENV/triton" triton
  fi
fi

check_build
stamp_key >"$VENV/.dlgs-stamp"
log "done: activate with 'source $VENV/bin/activate'"
