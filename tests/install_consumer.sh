#!/bin/sh
# Installs the library into a scratch prefix and builds a consumer against
# it both ways: find_package(ActiveKV CONFIG) and pkg-config.
set -eu
src=$1
work=$2
rm -rf "$work"
mkdir -p "$work"
cmake -S "$src" -B "$work/build" -DAKV_BUILD_TESTS=OFF -DAKV_BUILD_EXAMPLES=OFF \
  -DAKV_WITH_CUDA=OFF -DCMAKE_INSTALL_PREFIX="$work/prefix" >"$work/configure.log"
cmake --build "$work/build" -j2 >"$work/build.log"
cmake --install "$work/build" >"$work/install.log"
libdir=$(ls -d "$work/prefix"/lib*/ | head -n1)

# 1. CMake package config
cmake -S "$src/tests/consumer" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$work/prefix" >"$work/consumer-configure.log"
cmake --build "$work/consumer" >"$work/consumer-build.log"
LD_LIBRARY_PATH="$libdir" "$work/consumer/consumer"

# 2. pkg-config
PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --exists activekv
${CC:-cc} -std=c11 -o "$work/consumer-pc" "$src/tests/consumer/consumer.c" \
  $(PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --cflags --libs activekv)
LD_LIBRARY_PATH="$libdir" "$work/consumer-pc"

# The SONAME is versioned.
readelf -d "$libdir/libactivekv.so" | grep -q 'SONAME.*libactivekv.so.0.2'
echo "install consumer: cmake and pkg-config builds ran"
