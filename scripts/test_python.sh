#!/usr/bin/env bash
# The Python package: `pip install .` of this checkout into a virtual
# environment (build-py/venv; it sees the interpreter's own site-packages, so
# torch and transformers installed there are used), then its pytest suite
# against the installed package (python/tests). The install builds
# libactivekv.so with the project's CMake (scikit-build-core, pyproject.toml).
#   scripts/test_python.sh              # install and test
#   PYTHON=python3.12 scripts/test_python.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
venv=build-py/venv
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv --system-site-packages "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
"$venv/bin/python" -m pip install -q . pytest numpy
# from outside the checkout: the package imported is the installed one
(cd build-py && ACTIVEKV_LIBRARY= "$(pwd)/venv/bin/python" -c \
  'import activekv; print("activekv", activekv.__version__, "from", activekv.library_path())')
"$venv/bin/python" -m pytest -ra python/tests
