#!/bin/sh
# cli_decimal.sh ACTIVEKV CLI_EXPECT
# Decimal option values (--pcie-gbps, --rope-theta) are
# digits[.digits][(e|E)[+|-]digits]: the forms a person types are taken and
# read as typed; a blank or sign in front, hex, inf, nan, trailing junk and an
# empty value are each a usage error (exit 2) naming the flag and the value.
# strtod took " 1.5", "+1.5" and "0x1p4" (16). Each case runs through
# CLI_EXPECT (tests/cli_expect.sh); the first that fails ends the test.
set -u
cli=$1
expect=$2
run="decode --backend host --preset tiny --contexts 1 --tokens 64 --page-tokens 32 --steps 1 --warmup 0 --no-progress --json"

accepted() { # REGEX ARGS...: exit 0 and REGEX in the JSON
  regex=$1
  shift
  # shellcheck disable=SC2086
  sh "$expect" 0 "$regex" "$cli" $run "$@" || exit 1
}
refused() { # FLAG RANGE VALUE VALUE-AS-REGEX
  sh "$expect" 2 "^activekv: $1: expected a decimal number in $2 \\(digits\\[\\.digits\\]\\[e\\[\\+\\|-\\]digits\\]\\), got '$4'\$" \
    "$cli" $run "$1=$3" || exit 1
}

accepted '"pcie_gbps":55\.4,' --pcie-gbps 55.4 --rope-theta 500000.0
accepted '"pcie_gbps":1e\+06,' --pcie-gbps 1e6 --rope-theta 1e6
accepted '"pcie_gbps":0\.25,' --pcie-gbps 2.5E-1 --rope-theta 1E+4
accepted '"pcie_gbps":0\.001,' --pcie-gbps 1e-3 --rope-theta 010

pcie='0\.001\.\.1e\+06'
theta='1\.\.1e\+09'
refused --pcie-gbps "$pcie" ' 1.5' ' 1\.5'
refused --pcie-gbps "$pcie" '1.5 ' '1\.5 '
refused --pcie-gbps "$pcie" '+1.5' '\+1\.5'
refused --rope-theta "$theta" '+10000' '\+10000'
refused --rope-theta "$theta" '0x1p4' '0x1p4'
refused --pcie-gbps "$pcie" '0x10' '0x10'
refused --pcie-gbps "$pcie" 'inf' 'inf'
refused --rope-theta "$theta" 'INFINITY' 'INFINITY'
refused --pcie-gbps "$pcie" 'nan' 'nan'
refused --pcie-gbps "$pcie" '1.5x' '1\.5x'
refused --pcie-gbps "$pcie" '' ''
refused --pcie-gbps "$pcie" '.5' '\.5'
refused --pcie-gbps "$pcie" '5.' '5\.'
refused --pcie-gbps "$pcie" '1e' '1e'
refused --pcie-gbps "$pcie" '1e+' '1e\+'
refused --rope-theta "$theta" '1e999' '1e999'
refused --pcie-gbps "$pcie" '0.0001' '0\.0001'
exit 0
