#!/usr/bin/env bash
# Make Debian's fortunes package (the default text corpus of `spdkfac train --dataset text`)
# available when it is missing and we are allowed to install it; otherwise say how to point
# the CLI at another text (--data PATH).
# --print-packages: print the Debian package it installs, and change nothing.
set -u
package=fortunes
if [ "${1:-}" = --print-packages ]; then echo "$package"; exit 0; fi
dir=/usr/share/games/fortunes
[ -f "$dir/fortunes" ] && exit 0
if command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; else sudo=none; fi
  if [ "$sudo" != none ]; then
    echo "installing Debian package $package ..."
    $sudo apt-get update -qq >/dev/null 2>&1
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$package" >/dev/null 2>&1
  fi
fi
if [ ! -f "$dir/fortunes" ]; then
  echo "fortunes corpus not found in $dir: install fortunes (apt-get) or pass --data PATH" >&2
  echo "  (e.g. spdkfac train --model gpt --dataset text --data /path/to/text)" >&2
fi
exit 0
