#!/usr/bin/env bash
# Fetch, here, the wheels that the GPU machine's Python (3.12, with CUDA torch, pytest, typer,
# httpx, safetensors, numpy) lacks for tests/gpu and `atomd bench swap`; they go to .whl/, which
# scripts/gpu_check.sh installs there. Versions: the ones this checkout's .venv runs.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
pip=${PIP:-.venv/bin/python -m pip}
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
pkgs=()
for name in pydantic pydantic_core annotated_types typing_inspection zstandard pytest_asyncio; do
    pkgs+=("$name==$(version "$name")")
done
rm -rf .whl && mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64 any; do
    platforms+=(--platform "$p")
done
$pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${pkgs[@]}"
ls -la .whl
