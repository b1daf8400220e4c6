#!/usr/bin/env bash
# The served engine's two layouts on one GPU, in one device call: bench/engine/serve_ab.py with
# CORRAL_ENGINE_PROCESS=0 (step loop and server in one process) against =1 (the engine core in a
# process of its own), two `corral engine` processes sharing the card (each with
# gpu_memory_utilization 0.4), the same closed loop of streams, the order flipped every round.
# Writes /tmp/ab/serve-NAME/ and its log, then packs /tmp/ab into $OUT/ab.tgz (with ab.sh's runs,
# if any ran before it in the same call).
#   bash bench/gpu/serve_layout.sh NAME MODEL_DIR [serve_ab args, e.g. --preset tiny --rounds 6]
# A MODEL_DIR with no checkpoint gets serve_ab's --preset (tiny by default) written into it.
# SERVE_TIMEOUT (300 s) caps the run: SIGINT first, so serve_ab stops both engines on its way out.
set -u
name=$1 model=$2
shift 2
out=/tmp/ab
mkdir -p "$out"
echo "=== serve-$name $model $(date +%T)"
timeout -s INT -k 45 "${SERVE_TIMEOUT:-300}" python3 -m bench.engine.serve_ab --base tree --base-env CORRAL_ENGINE_PROCESS=0 \
    --tree-env CORRAL_ENGINE_PROCESS=1 --engine-cpus all --engine-arg gpu_memory_utilization=0.4 \
    --warmup-rounds 2 --model-dir "$model" --out "$out/serve-$name" "$@" > "$out/serve-$name.log" 2>&1
echo "rc $?"
pkill -f "corral_cli.main engine" && sleep 3  # none should be left; if some are, they hold the GPU
tail -14 "$out/serve-$name.log"
(cd "$out" && tar czf "$OUT/ab.tgz" .)
