#!/bin/sh
# Fails if libactivekv.so exports any symbol that does not start with akv_
# (the version node ACTIVEKV_* of the linker script is not a symbol).
set -eu
lib=$1
syms=$(nm -D --defined-only "$lib" | awk '{print $3}' | grep -v '^ACTIVEKV_' | sort -u)
bad=$(printf '%s\n' "$syms" | grep -v '^akv_' | grep -v '^$' || true)
count=$(printf '%s\n' "$syms" | grep -c '^akv_' || true)
if [ -n "$bad" ]; then
  echo "non-akv_ symbols exported:"; echo "$bad"; exit 1
fi
echo "exports: $count symbols, all akv_"
[ "$count" -gt 20 ]
