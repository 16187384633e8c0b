#!/usr/bin/env bash
# Make Debian's dataset-fashion-mnist available when it is missing and we are allowed to
# install it; otherwise say how to point the CLI at the IDX files (--data DIR).
# --print-packages: print the Debian package it installs, and change nothing.
set -u
package=dataset-fashion-mnist
if [ "${1:-}" = --print-packages ]; then echo "$package"; exit 0; fi
dir=/usr/share/datasets/fashion-mnist
[ -f "$dir/train-images-idx3-ubyte.gz" ] && exit 0
if command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; else sudo=none; fi
  if [ "$sudo" != none ]; then
    echo "installing Debian package $package ..."
    $sudo apt-get update -qq >/dev/null 2>&1
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package" >/dev/null 2>&1
  fi
fi
if [ ! -f "$dir/train-images-idx3-ubyte.gz" ]; then
  echo "Fashion-MNIST not found in $dir: install dataset-fashion-mnist (apt-get) or pass --data DIR" >&2
  echo "  (e.g. make demo DEMO_ARGS='--data /path/to/idx/files')" >&2
fi
exit 0
