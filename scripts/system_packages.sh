#!/usr/bin/env bash
# Debian packages the engine uses when present: tcmalloc (engine processes run twice as fast on
# CPU under it; see engine/allocator.py) and a C compiler (the CPU kernels, compiled on first
# use). Installed when run as root with apt-get; otherwise a note says what is missing.
set -uo pipefail
missing=()
[ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] || [ -e /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4 ] \
  || missing+=(libtcmalloc-minimal4)
command -v cc >/dev/null 2>&1 || missing+=(gcc)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") >/dev/null 2>&1 \
    || echo "note: could not install ${missing[*]}; the engine runs slower on CPU without them" >&2
else
  echo "note: ${missing[*]} not installed; the engine runs slower on CPU without them" >&2
fi
exit 0
