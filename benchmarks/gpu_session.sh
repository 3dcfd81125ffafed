#!/usr/bin/env bash
# Issue 35's and issue 54's GPU measurements on a lent H100/H200 (../shared/GPU.md), in three steps:
#
#   here, once:  bash benchmarks/gpu_session.sh prepare
#                  wheels the GPU machine lacks (cp312), SmolLM2's GGUF in two parts and the
#                  code of HEAD (head.tar), under gpu_carry/ (git-ignored; a device call carries
#                  at most 64 MiB)
#   device call 1 (carry gpu_carry/part1, a few seconds):  bash benchmarks/gpu_session.sh stage
#                  leaves the GGUF's first part in /tmp (kept while the machine stays warm: make
#                  call 2 at once)
#   device call 2 (carry gpu_carry/part2, timeout_s 580):  bash benchmarks/gpu_session.sh run
#                  installs the wheels, joins the GGUF, runs `benchmarks/gpu.py --plan issue35`
#                  from HEAD's code (at most 510 s: a commit to name beside the figures, whatever
#                  the working tree holds); results in $OUT/gpu.md and $OUT/gpu.json as each
#                  check ends
#   issue 54 part 1 (one call, carry gpu_carry/part2, timeout_s 580, no GGUF needed):
#                  bash benchmarks/gpu_session.sh run54
#                  installs the wheels (liger-kernel among them), runs `benchmarks/gpu.py --plan
#                  issue54` from HEAD's code: the training step's options (bf16 compute weights,
#                  token micro-batches, compile, liger) at the SmolLM2 and 0.5B shapes
set -euo pipefail

CARRY=gpu_carry
GGUF="${GGUF:-$HOME/.cache/pipelinerl/models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf}"
# What the GPU machine lacks (GPU.md), at the versions this project is tested with.
WHEELS=(pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
        redis==8.1.0 pebble==5.2.3 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0
        xxhash==4.1.0 liger-kernel==0.8.5)

case "${1:-}" in
  prepare)
    [[ -f "$GGUF" ]] || { echo "no GGUF at $GGUF: run 'pipelinerl prepare smollm2' first" >&2; exit 1; }
    rm -rf "$CARRY" && mkdir -p "$CARRY/part1" "$CARRY/part2/wheels"
    pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
      -d "$CARRY/part2/wheels" "${WHEELS[@]}"
    half=$(( ($(stat -c %s "$GGUF") + 1) / 2 ))
    head -c "$half" "$GGUF" > "$CARRY/part1/smol.gguf.a"
    tail -c +"$((half + 1))" "$GGUF" > "$CARRY/part2/smol.gguf.b"
    sha256sum "$GGUF" | cut -d' ' -f1 > "$CARRY/part2/smol.gguf.sha256"
    git archive --format=tar -o "$CARRY/part2/head.tar" HEAD src examples benchmarks/gpu.py
    git rev-parse --short HEAD > "$CARRY/part2/head.commit"
    du -sh "$CARRY"/part1 "$CARRY"/part2
    ;;
  stage)
    cp "$CARRY/part1/smol.gguf.a" /tmp/smol.gguf.a && ls -la /tmp/smol.gguf.a
    ;;
  run54)
    pip install --quiet --no-index --no-deps --target /tmp/site "$CARRY"/part2/wheels/*.whl
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    echo "code: $(cat "$CARRY/part2/head.commit")"
    out=$(realpath -m "${OUT:-gpu-out}")
    rm -rf /tmp/head && mkdir -p /tmp/head && tar -xf "$CARRY/part2/head.tar" -C /tmp/head
    cd /tmp/head && PYTHONPATH="src:/tmp/site" python benchmarks/gpu.py --plan issue54 --out "$out"
    ;;
  run)
    pip install --quiet --no-index --no-deps --target /tmp/site "$CARRY"/part2/wheels/*.whl
    cat /tmp/smol.gguf.a "$CARRY/part2/smol.gguf.b" > /tmp/smol.gguf
    echo "$(cat "$CARRY/part2/smol.gguf.sha256")  /tmp/smol.gguf" | sha256sum --check
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    echo "code: $(cat "$CARRY/part2/head.commit")"
    out=$(realpath -m "${OUT:-gpu-out}")
    rm -rf /tmp/head && mkdir -p /tmp/head && tar -xf "$CARRY/part2/head.tar" -C /tmp/head
    cd /tmp/head && PYTHONPATH="src:/tmp/site" python benchmarks/gpu.py --plan issue35 \
      --gguf /tmp/smol.gguf --out "$out"
    ;;
  *)
    echo "usage: $0 prepare | stage | run | run54   (see the comment at the top)" >&2; exit 2
    ;;
esac
