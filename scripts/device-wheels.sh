#!/usr/bin/env bash
# The Python wheels a GPU machine without network lacks (torch there, but no DeepSpeed, pydantic or
# hjson), downloaded here into DIR (default .whl, git-ignored) so that a device call can carry them;
# scripts/gpu.sh installs them there. Python 3.12 / x86-64 wheels, as that machine runs.
#   bash scripts/device-wheels.sh [DIR] [DEEPSPEED_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
ds=${2:-0.19.8}
mkdir -p "$dir"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d "$dir" pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.7.0 typing-inspection==0.4.5 hjson==3.1.0
# DeepSpeed publishes a source archive only: build its pure-Python wheel (no ops are compiled here).
python3 -m pip wheel -q --no-deps -w "$dir" "deepspeed==$ds"
ls -1 "$dir"
