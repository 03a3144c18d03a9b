#!/usr/bin/env bash
# Installs what DRUM needs on Debian 12 when it is missing: rdma-core's user space and tools
# (softrnic and the shim run unmodified verbs and RDMA CM programs), a C toolchain, iproute2 for the
# emulated hosts, a font for the plots, third-party RDMA stacks the conformance tests run
# (qperf, UCX, Open MPI, pyverbs), Chromium to render the testbed's report in a test, and the
# Rust components the checks use.
set -euo pipefail

packages=(rdma-core libibverbs-dev ibverbs-utils rdmacm-utils perftest clang cmake gcc pkg-config iproute2 fonts-dejavu-core
          librdmacm-dev qperf ucx-utils openmpi-bin libopenmpi-dev python3-pyverbs chromium)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
    [ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
    echo "setup: no Rust toolchain found; DRUM needs rustc/cargo >= 1.85 (rustup: https://rustup.rs)" >&2
    exit 1
fi
if command -v rustup >/dev/null 2>&1; then
    for c in rustfmt clippy; do
        rustup component list --installed 2>/dev/null | grep -q "^$c" || rustup component add "$c" >/dev/null
    done
fi
