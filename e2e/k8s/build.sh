#!/usr/bin/env bash
# Builds the e2e Kubernetes toolchain (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl, kwok, helm) from the Go module proxy into a cache outside the clone, keyed by the pinned
# versions. Idempotent: a warm run builds nothing. Progress goes to stderr; the last line on stdout is
# the bin directory. Exit code 3 means Go is not installed (the k8s tests then skip with that reason).
# `build.sh --check` builds nothing: exit code 0 (and the bin directory) when the cache is ready, else 1.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"

# Bump when the build commands below change in a way that changes the binaries.
BUILD_REV=1

log() { echo "[k8s-tools] $*" >&2; }

if ! command -v go >/dev/null 2>&1; then
    log "error: the go command is not installed; cannot build the Kubernetes e2e toolchain"
    exit 3
fi
export GOTOOLCHAIN=local
export GOFLAGS="${GOFLAGS:-} -mod=readonly"

cache_root="${CORRAL_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/corral-e2e}"
key="$(
    {
        echo "rev=$BUILD_REV"
        go env GOVERSION GOOS GOARCH
        cat "$here/versions.env" "$here"/go/*/go.mod "$here"/go/*/go.sum
    } | sha256sum | cut -c1-16
)"
out="$cache_root/$key"
bin="$out/bin"

stages="$out/kwok-stages.yaml"
marker="$out/ready"
if [ -f "$marker" ]; then
    echo "$bin"
    exit 0
fi
if [ "${1:-}" = "--check" ]; then
    exit 1
fi

mkdir -p "$bin"
exec 9>"$out/lock"
if ! flock -n 9; then
    log "another build is running in $out; waiting for it"
    flock 9
fi
if [ -f "$marker" ]; then
    echo "$bin"
    exit 0
fi

minor="${KUBERNETES_VERSION#v1.}"
minor="${minor%%.*}"
k8s_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    k8s_ldflags+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    k8s_ldflags+=" -X $pkg.gitTreeState=clean"
done

# Nice: the machines' cores are shared.
build() { nice -n 10 go "$@"; }

# step NAME FUNCTION BINARY...: runs FUNCTION unless every BINARY is already in the cache.
step() {
    local name="$1" fn="$2"
    shift 2
    local missing=0 b
    for b in "$@"; do [ -x "$bin/$b" ] || missing=1; done
    if [ "$missing" = 0 ]; then
        log "$name: cached"
        return
    fi
    local start=$SECONDS
    log "$name: building (this takes minutes when cold) ..."
    "$fn"
    log "$name: done in $((SECONDS - start))s"
}

build_kubernetes() {
    # One go build for all four binaries, so shared packages compile once.
    (cd "$here/go/kubernetes" && build build -ldflags "$k8s_ldflags" -o "$bin/" \
        k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
        k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl)
}

build_etcd() {
    (cd "$here/go/etcd" && build build -ldflags "-s -w" -o "$bin/etcd" go.etcd.io/etcd/server/v3)
}

build_kwok() {
    # go install pkg@version ignores the surrounding module, so run it outside any go.mod.
    (cd "$out" && GOBIN="$bin" GOFLAGS= build install \
        -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION" \
        "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION")
}

build_helm() {
    (cd "$out" && GOBIN="$bin" GOFLAGS= build install \
        -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" \
        "helm.sh/helm/v4/cmd/helm@$HELM_VERSION")
}

# kwok run on its own (not through kwokctl) needs Stage objects that say how fake Nodes and Pods
# change state; take the fast ones shipped in kwok's own module rather than copying them into this repo.
copy_kwok_stages() {
    local dir
    dir="$(cd "$out" && GOFLAGS= go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" |
        sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')"
    local stage_dir="$dir/kustomize/stage"
    local file first=1
    : >"$stages.tmp"
    for file in node/fast/node-initialize.yaml node/heartbeat/node-heartbeat.yaml \
        pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
        [ "$first" = 1 ] || echo "---" >>"$stages.tmp"
        first=0
        cat "$stage_dir/$file" >>"$stages.tmp"
    done
    mv "$stages.tmp" "$stages"
    log "kwok stages: copied from $stage_dir"
}

total_start=$SECONDS
log "building into $out (Kubernetes $KUBERNETES_VERSION, etcd $ETCD_VERSION, kwok $KWOK_VERSION, helm $HELM_VERSION)"
step "etcd $ETCD_VERSION" build_etcd etcd
step "kubernetes $KUBERNETES_VERSION" build_kubernetes kube-apiserver kube-controller-manager kube-scheduler kubectl
step "kwok $KWOK_VERSION" build_kwok kwok
step "helm $HELM_VERSION" build_helm helm
[ -f "$stages" ] || copy_kwok_stages
touch "$marker"
log "all binaries ready in $((SECONDS - total_start))s"
echo "$bin"
