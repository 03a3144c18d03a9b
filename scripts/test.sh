#!/usr/bin/env bash
# All of DRUM's checks: formatting, lints, and every test of the workspace.
# Tests that need privileges (namespaces) detect whether they have them and say when they skip.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
export CARGO_TERM_COLOR=never
cargo fmt --all -- --check
# The shim's modules import each other without a cycle (issue 20); the check checks itself first.
python3 scripts/shim-module-cycles.py --self-test
python3 scripts/shim-module-cycles.py >/dev/null
cargo clippy --workspace --all-targets --release -- -D warnings
# One build of everything the tests need: the softrnic provider and the shim are cdylibs that
# the tests load and `cargo test` alone does not build, and building the test targets makes
# the build resolve features as `cargo test` does (dev-dependencies included), so the test
# step compiles nothing again. A plain `cargo build` here recompiled ~60 crates for the tests
# (6.7 min of a 28-min CI run). Not `--all-targets`: the criterion benchmark is not a test.
cargo build --workspace --release --lib --bins --tests --examples
cargo test --workspace --release
# Coverage-guided fuzzing of every decoder, 10 s per target (docs/fuzzing.md).
bash scripts/fuzz.sh 10
# The systemd units against the binaries just built (skips where systemd-analyze is missing).
bash deploy/verify.sh
