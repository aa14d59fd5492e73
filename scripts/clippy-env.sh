# Sourced by scripts/test.sh and scripts/cuda-build.sh: makes the cargo builds that follow lint
# the workspace's own crates as `cargo clippy --all-targets -- -D warnings` does. clippy-driver
# becomes the rustc wrapper of workspace members (dependencies keep plain rustc, so they are
# the same units as in any other build of the same profile), and its arguments go where
# cargo-clippy puts them (CLIPPY_ARGS, separated by __CLIPPY_HACKERY__). A lint or a compiler
# warning in our code then fails the build itself.
clippy_driver="$(rustup which clippy-driver 2>/dev/null || command -v clippy-driver || true)"
if [ -z "$clippy_driver" ]; then
  echo "clippy-driver not found: rustup component add clippy" >&2
  exit 1
fi
export RUSTC_WORKSPACE_WRAPPER="$clippy_driver"
export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
