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
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${DLGS_VENV:-.venv}
PY=python3
log() { printf '[install] %s\n' "$*" >&2; }

pin() { sed -n "s/^$1==\(.*\)$/\1/p" constraints.txt; }
HVD_VERSION=$(pin horovod)

stamp_key() {
  cat constraints.txt tools/install.sh setup.py | sha256sum | cut -d' ' -f1
}

check_build() {
  local out
  out=$("$VENV/bin/horovodrun" --check-build 2>&1) || { echo "$out" >&2; return 1; }
  local ok=0
  for want in "\[X\] TensorFlow" "\[X\] PyTorch"; do
    grep -q "$want" <<<"$out" || { log "horovodrun --check-build: missing ${want#\\[X\\] }"; ok=1; }
  done
  # Controllers and tensor operations: both sections must list MPI and Gloo.
  if [ "$(grep -c '\[X\] MPI' <<<"$out")" -lt 2 ]; then log "horovodrun --check-build: MPI missing"; ok=1; fi
  if [ "$(grep -c '\[X\] Gloo' <<<"$out")" -lt 2 ]; then log "horovodrun --check-build: Gloo missing"; ok=1; fi
  [ $ok -eq 0 ] || { echo "$out" >&2; return 1; }
  log "horovodrun --check-build: PyTorch, TensorFlow, MPI and Gloo present"
}

if [ -f "$VENV/.dlgs-stamp" ] && [ "$(cat "$VENV/.dlgs-stamp")" = "$(stamp_key)" ]; then
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
"$VPY" -m pip install -q -c constraints.txt torch tensorflow-cpu numpy

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
  if [ -n "$wheel" ]; then
    log "installing prebuilt $wheel"
    "$VPY" -m pip install -q --no-deps "$wheel"
    "$VPY" -m pip install -q -c constraints.txt cloudpickle psutil pyyaml packaging cffi
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
    CMAKE_POLICY_VERSION_MINIMUM=3.5 "$VPY" -m pip install -q --no-build-isolation -c constraints.txt "$src"
  fi
fi

# 4. dlgs itself with test and benchmark extras.
log "installing dlgs (editable) with dev and benchmark extras"
"$VPY" -m pip install -q -c constraints.txt -e ".[torch,tensorflow,benchmarks,dev]"

check_build
stamp_key >"$VENV/.dlgs-stamp"
log "done: activate with 'source $VENV/bin/activate'"
