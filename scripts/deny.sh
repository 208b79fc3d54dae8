#!/usr/bin/env bash
# The dependency gate (cargo-deny, configured in deny.toml): licences, bans and
# sources always; RustSec advisories whenever the advisory database can be
# fetched (it lives on GitHub, which some build sandboxes cannot reach: then the
# run says so plainly instead of passing in silence).
#
# cargo-deny is built once into the same cache as the control plane
# (VKD_CACHE_DIR, default ~/.cache/vkd) and reused by later runs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
version=0.20.2
cache=${VKD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vkd}/tools
deny=$cache/bin/cargo-deny
if ! [ -x "$deny" ] || ! "$deny" --version 2>/dev/null | grep -q " $version"; then
  if command -v cargo-deny >/dev/null && cargo-deny --version | grep -q " $version"; then
    deny=$(command -v cargo-deny)
  else
    echo "deny: building cargo-deny $version into $cache (once; about 15 minutes on 2 cores)" >&2
    CARGO_TARGET_DIR="$cache/target" cargo install --quiet --locked --root "$cache" "cargo-deny@$version"
  fi
fi
"$deny" check licenses bans sources
if timeout 20 git ls-remote https://github.com/rustsec/advisory-db HEAD >/dev/null 2>&1; then
  "$deny" check advisories
else
  echo "deny: advisories NOT checked: the RustSec database (github.com/rustsec/advisory-db) is unreachable from this machine" >&2
fi
