#!/usr/bin/env bash
# Put the GCIDE dictionary (the corpus of `spdkfac train --dataset gcide`) at
# /usr/share/dictd/gcide.dict.dz when it is missing and we may write there; otherwise say
# how to point the CLI at another copy (--data PATH).
#
# Debian's dict-gcide package depends on a dictionary server (dictd, started at boot), so
# this script does not install the package: it fetches the .deb with `apt-get download`,
# unpacks it with `dpkg-deb -x` into a temporary folder, and copies out the data file and
# its copyright notice only. No server is installed and dpkg does not record the package.
#
#   bash scripts/ensure_gcide.sh                    # fetch when missing
#   bash scripts/ensure_gcide.sh --print-packages   # the Debian package it reads; no change
set -u
package=dict-gcide
if [ "${1:-}" = --print-packages ]; then echo "$package"; exit 0; fi
file=/usr/share/dictd/gcide.dict.dz
copyright=/usr/share/doc/$package/copyright
[ -f "$file" ] && exit 0
if command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; else sudo=none; fi
  if [ "$sudo" != none ]; then
    echo "fetching $file from Debian's $package (the data file only; no dictd server) ..."
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    $sudo apt-get update -qq >/dev/null 2>&1
    (cd "$work" && apt-get download -qq "$package" >/dev/null 2>&1) \
      && dpkg-deb -x "$work"/"$package"_*.deb "$work/unpacked" \
      && $sudo install -D -m 644 "$work/unpacked$copyright" "$copyright" \
      && $sudo install -D -m 644 "$work/unpacked$file" "$file"
  fi
fi
if [ ! -f "$file" ]; then
  echo "GCIDE dictionary not found at $file: run scripts/ensure_gcide.sh as root, or pass --data PATH" >&2
  echo "  (e.g. spdkfac train --model gpt --dataset gcide --data /path/to/gcide.dict.dz)" >&2
fi
exit 0
