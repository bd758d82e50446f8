#!/bin/sh
# Configures with the default install prefix, then installs into a scratch
# prefix chosen only at install time (`cmake --install --prefix`), as a
# packager or a user does. Then, from that prefix:
#   1. a consumer built with find_package(ActiveKV CONFIG),
#   2. a consumer built with pkg-config alone (the .pc file must point into
#      the prefix it was installed to, not the configure-time one),
#   3. the installed `activekv` CLI, run with no LD_LIBRARY_PATH: its RPATH
#      must find the prefix's libactivekv,
#   4. the versioned SONAME.
# Any failure exits nonzero with the reason on stderr.
set -eu
src=$1
work=$2
rm -rf "$work"
mkdir -p "$work"
fail() {
  echo "install consumer: $*" >&2
  exit 1
}

# No CMAKE_INSTALL_PREFIX here: the prefix is chosen after configuring.
cmake -S "$src" -B "$work/build" -DAKV_BUILD_TESTS=OFF -DAKV_BUILD_EXAMPLES=ON \
  -DAKV_WITH_CUDA=OFF >"$work/configure.log"
cmake --build "$work/build" -j2 --target activekv activekv_cli >"$work/build.log"
prefix="$work/prefix"
cmake --install "$work/build" --prefix "$prefix" >"$work/install.log"
libdir=$(ls -d "$prefix"/lib*/ | head -n1)
libdir=${libdir%/}
[ -f "$libdir/pkgconfig/activekv.pc" ] || fail "no activekv.pc under $libdir/pkgconfig"

# 1. CMake package config
cmake -S "$src/tests/consumer" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$prefix" >"$work/consumer-configure.log"
cmake --build "$work/consumer" >"$work/consumer-build.log"
LD_LIBRARY_PATH="$libdir" "$work/consumer/consumer"

# 2. pkg-config: every -I and -L it gives must lie inside the prefix.
pc() { PKG_CONFIG_PATH="$libdir/pkgconfig" PKG_CONFIG_LIBDIR="$libdir/pkgconfig" pkg-config "$@"; }
pc --exists activekv || fail "pkg-config does not find activekv in $libdir/pkgconfig"
real_prefix=$(cd "$prefix" && pwd -P)
for flag in $(pc --cflags-only-I --libs-only-L activekv); do
  dir=${flag#-[IL]}
  [ -d "$dir" ] || fail "pkg-config gives $flag, which is not a directory"
  case $(cd "$dir" && pwd -P) in
    "$real_prefix"/*) ;;
    *) fail "pkg-config gives $flag, outside the install prefix $prefix" ;;
  esac
done
${CC:-cc} -std=c11 -o "$work/consumer-pc" "$src/tests/consumer/consumer.c" $(pc --cflags --libs activekv)
LD_LIBRARY_PATH="$libdir" "$work/consumer-pc"

# 3. The installed CLI runs from the prefix without LD_LIBRARY_PATH, and the
#    library it loads is the prefix's.
cli="$prefix/bin/activekv"
[ -x "$cli" ] || fail "no $cli"
readelf -d "$cli" | grep -E 'R(UN)?PATH' | grep -q 'ORIGIN' || fail "$cli has no \$ORIGIN RPATH"
loaded=$(env -u LD_LIBRARY_PATH ldd "$cli" | sed -n 's/.*libactivekv[^ ]* => \([^ ]*\) .*/\1/p')
[ -n "$loaded" ] || fail "the dynamic linker does not find libactivekv for $cli"
[ "$(cd "$(dirname "$loaded")" && pwd -P)" = "$(cd "$libdir" && pwd -P)" ] ||
  fail "$cli loads $loaded, not the prefix's library in $libdir"
env -u LD_LIBRARY_PATH "$cli" --version | grep -q "libactivekv [0-9.]* loaded" ||
  fail "$cli --version failed"
env -u LD_LIBRARY_PATH "$cli" fit --preset tiny --contexts 2 --tokens 100 --page-tokens 32 \
  --host-pool-gib 1 | grep -q '^verdict: fits' || fail "$cli fit failed"

# 4. The SONAME is versioned.
readelf -d "$libdir/libactivekv.so" | grep -q 'SONAME.*libactivekv.so.0.3' || fail "SONAME is not libactivekv.so.0.3"
echo "install consumer: installed to a prefix chosen at install time; cmake and pkg-config builds ran; the installed activekv ran from the prefix"
