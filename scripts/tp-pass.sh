#!/usr/bin/env bash
# tp-pass.sh - the tensor parallel part of the GPU pass, one command on any
# machine kind: builds the project (scripts/gpu-pass.sh, step build) and runs
# the NCCL groups on every visible GPU (step tp). With one GPU this is the
# N=1 path through NCCL; with two it is the TP=2 run, the missing-rank case
# included. Then the CLI on the CUDA backend (rank r on GPU r, NCCL): with
# two GPUs `activekv decode --preset llama3-8b --contexts 4 --tokens 31744
# --tp 2 --route stage --check` and the plain TP=1 run, printing TP=1 against
# TP=2 tokens/s; with one GPU `--tp 1 --check` (one rank through NCCL) and
# the plain run. NCCL_NVLS_ENABLE=0 is set for every run.
#   OUT=<dir> scripts/tp-pass.sh       # files under $OUT: build.log tp.log tp-cli.log summary.txt
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
AKV_STEPS="build tp" exec bash scripts/gpu-pass.sh "$@"
