#!/usr/bin/env bash
# On a machine with a CUDA GPU and torch: every CUDA test (they skip elsewhere), then the CUDA
# benchmarks at batch 1 and small batches (`bench --streams --device cuda --streams-to S --page`:
# one stream's hop of musicnn and the 1-block continual Nystrom model, and every shipped model's
# step with and without its CUDA graph; docs/benchmarks/streams-cuda*-to*.json and the page).
# `--full` adds the capacity runs (musicnn in TF32, then in bf16, with the continual Nystrom model
# from 256 streams, about 5 minutes each on an H100, each with its error against float32; then
# float32 with the five shipped models from 64).
# A bare GPU image without librosa, soundfile or soxr takes their wheels from .whl/ (git-ignored),
# fetched beforehand on a machine with PyPI, for that machine's Python (here 3.12):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl librosa==0.11.0 soxr soundfile audioread pooch decorator \
#     cffi pycparser platformdirs
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/nystream-site .whl/*.whl
    export PYTHONPATH=/tmp/nystream-site
fi
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device here')"
python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name(0))"
python3 -m pytest -q -p no:cacheprovider -k cuda \
    tests/models/test_stream_batch.py tests/audio/test_musicnn_batch.py tests/app/test_streams.py \
    tests/audio/test_audio_musicnn.py tests/audio/test_musicnn_precision.py
python3 main.py bench --streams --device cuda --models continual_nystrom --streams-to 4 --page
python3 main.py bench --streams --device cuda --streams-to 16 --page
if [[ "${1:-}" == "--full" ]]; then
    python3 main.py bench --streams --device cuda --models continual_nystrom --precision tf32 --streams-from 256 --page
    python3 main.py bench --streams --device cuda --models continual_nystrom --precision bf16 --streams-from 256 --page
    python3 main.py bench --streams --device cuda --streams-from 64 --page
fi
