#!/usr/bin/env bash
# The served phase (W2 arriving at 10 and 20 req/s into one stepped engine) A/B in one device call,
# each run a fresh process with a Triton kernel cache of its own (TRITON_CACHE_DIR): A then B on
# empty caches (a fresh pod: the start-up's warm-up compiles every attention variant), then B then
# A again on the caches they filled. Each rate's log line says how many kernel variants compiled
# while requests waited (0 is the goal: a compile is a stalled step); each engine's "engine up in"
# and "attention warm-up" lines say what the warm-up cost, cold and warm. Packs /tmp/ab into
# $OUT/ab.tgz after each run; at the end bench/gpu/served_report.py puts the four side by side
# (served-ab.md, .json, .png).
#   bash bench/gpu/served_ab.sh SHA SETTING_A SETTING_B      (e.g. CORRAL_ASYNC_SCHEDULING=auto CORRAL_ASYNC_SCHEDULING=0)
# Run from the repository root on the device, after the install line (README.md); AB_TIMEOUT caps
# each run (150 s; the first also writes the 8B checkpoint, about a minute, unless one is there);
# AB_ARGS adds acceptance arguments (AB_ARGS="--smoke --device cpu" tries the script on a CPU).
set -u
sha=$1 a=$2 b=$3
out=/tmp/ab
mkdir -p "$out"
pack() { (cd "$out" && tar czf "$OUT/ab.tgz" .); }
run() {  # name, setting, cache
    echo "=== $1 ($2) $(date +%T)"
    env $2 TRITON_CACHE_DIR="/tmp/triton-$3" timeout "${AB_TIMEOUT:-150}" python3 -m bench.gpu.acceptance \
        --out "$out/$1" --commit "$sha" --phases env,served --systems corral ${AB_ARGS:-} > "$out/$1.log" 2>&1
    echo "rc $?"
    grep -E "attention warm-up|engine up in|served W2|new Triton kernel|Error" "$out/$1.log" | cut -c1-300 | tail -6
    pack
}
rm -rf /tmp/triton-A /tmp/triton-B
run A-cold "$a" A
run B-cold "$b" B
run B-warm "$b" B
run A-warm "$a" A
python3 -m bench.gpu.served_report "$out"  # served-ab.md / .json / .png beside the runs
pack
echo "=== done $(date +%T)"
