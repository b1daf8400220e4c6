#!/usr/bin/env bash
# Build the OpenTelemetry Collector for the tracing e2e (manifest.yaml) with the collector's builder,
# both from the Go module proxy, and print the binary's path. Cached under
# ${CORRAL_E2E_CACHE:-~/.cache/corral-e2e}/otelcol-<hash of this script, the manifest, Go's version>;
# a warm run builds nothing. `--check` only says whether the cache is warm (exit 0) or not (1).
set -euo pipefail
BUILDER_VERSION=v0.165.0
here="$(cd "$(dirname "$0")" && pwd)"
key="$( (cat "$here/build.sh" "$here/manifest.yaml"; go env GOVERSION) | sha256sum | cut -c1-16)"
out="${CORRAL_E2E_CACHE:-$HOME/.cache/corral-e2e}/otelcol-$key"
binary="$out/dist/corral-otelcol"
if [ -x "$binary" ]; then
    echo "$binary"
    exit 0
fi
if [ "${1:-}" = "--check" ]; then
    exit 1
fi
mkdir -p "$out"
exec 9>"$out/lock"
flock 9
if [ ! -x "$binary" ]; then
    start=$SECONDS
    echo "building the OpenTelemetry Collector into $out (minutes when cold) ..." >&2
    export GOTOOLCHAIN=local GOFLAGS=-mod=mod GOBIN="$out/bin"
    nice -n 10 go install "go.opentelemetry.io/collector/cmd/builder@$BUILDER_VERSION" >&2
    sed "s|^dist:|dist:\n  output_path: $out/dist|" "$here/manifest.yaml" >"$out/manifest.yaml"
    (cd "$out" && nice -n 10 "$out/bin/builder" --config "$out/manifest.yaml" >&2)
    echo "built in $((SECONDS - start))s" >&2
fi
echo "$binary"
