#!/usr/bin/env bash
# A/B of engine switches on a GPU, in one device call: for each setting (environment assignments,
# e.g. "CORRAL_ASYNC_SCHEDULING=0" "CORRAL_ASYNC_SCHEDULING=1"), the acceptance's batch1 and
# overhead phases, then Corral's W1/W2 throughput and the served phase (B then A), then the
# throughput once more (A then B); everything packed into $OUT/ab.tgz after each run (one file
# comes back however many runs finished).
#   bash bench/gpu/ab.sh SHA SETTING_A SETTING_B [PHASES]
# AB_RUNS picks runs by name, in its order (default: all six below, e.g. AB_RUNS="A-speed" then
# later AB_RUNS="B-speed" to put other work between them); AB_TIMEOUT caps each run (240 s).
# Run from the repository root on the device (see README.md for the install line before it).
set -u
sha=$1 a=$2 b=$3 phases=${4:-env,bandwidth,batch1,overhead}
out=/tmp/ab
mkdir -p "$out"
nvidia-smi -L > "$out/gpu.txt" 2>&1
lscpu > "$out/lscpu.txt" 2>&1
pack() { (cd "$out" && tar czf "$OUT/ab.tgz" .); }
run() {  # name, setting, phases, extra args...
    local name=$1 setting=$2 ph=$3
    shift 3
    echo "=== $name ($setting) $ph $(date +%T)"
    env $setting timeout "${AB_TIMEOUT:-240}" python3 -m bench.gpu.acceptance --out "$out/$name" --commit "$sha" \
        --phases "$ph" "$@" > "$out/$name.log" 2>&1
    echo "rc $?"
    grep -E "overhead at|corral W|served W2|\| batch1|Error" "$out/$name.log" | tail -6
    pack
}
for name in ${AB_RUNS:-A-speed B-speed B-tp1 A-tp1 A-tp2 B-tp2}; do
    case $name in
        A-speed) run A-speed "$a" "$phases" ;;
        B-speed) run B-speed "$b" "$phases" ;;
        A-tp1) run A-tp1 "$a" env,throughput,served --systems corral ;;
        B-tp1) run B-tp1 "$b" env,throughput,served --systems corral ;;
        A-tp2) run A-tp2 "$a" env,throughput --systems corral ;;
        B-tp2) run B-tp2 "$b" env,throughput --systems corral ;;
        *) echo "unknown run $name" ;;
    esac
done
echo "=== done $(date +%T)"
