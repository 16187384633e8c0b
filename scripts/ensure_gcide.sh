#!/usr/bin/env bash
# Make Debian's dict-gcide package (the dictionary of `spdkfac train --dataset gcide`)
# available when it is missing and we are allowed to install it; otherwise say how to point
# the CLI at another copy (--data PATH).
set -u
file=/usr/share/dictd/gcide.dict.dz
[ -f "$file" ] && exit 0
if command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; else sudo=none; fi
  if [ "$sudo" != none ]; then
    echo "installing Debian package dict-gcide ..."
    $sudo apt-get update -qq >/dev/null 2>&1
    # --no-install-recommends: the dictionary file only, not the dictd server.
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends dict-gcide >/dev/null 2>&1
  fi
fi
if [ ! -f "$file" ]; then
  echo "GCIDE dictionary not found at $file: install dict-gcide (apt-get) or pass --data PATH" >&2
  echo "  (e.g. spdkfac train --model gpt --dataset gcide --data /path/to/gcide.dict.dz)" >&2
fi
exit 0
