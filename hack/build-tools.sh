#!/usr/bin/env bash
# Builds the local control plane's binaries from Go modules with the plain `go` command:
# kube-apiserver, kube-scheduler, kube-controller-manager, kubectl, etcd, kwok and helm.
# Each lands in ~/.cache/modeld/tools/<name>-<version>-<key>/ where key hashes the tools module and the Go version,
# so a second run builds nothing. Prints the bin directory holding links to all of them on its last line.
set -o errexit -o nounset -o pipefail
cd "$(dirname "$0")/.."
source hack/versions.env

CACHE=${MODELD_CACHE:-$HOME/.cache/modeld}
BIN=$CACHE/bin
mkdir -p "$BIN"
# One build at a time: a second caller waits, then finds everything built.
exec 9>"$CACHE/.build-tools.lock"
flock 9
export CGO_ENABLED=0 GOFLAGS=-trimpath
go_version=$(go env GOVERSION)

key() {  # the tools module's go.mod + go.sum and the Go version decide what gets built
  cat "hack/tools/$1/go.mod" "hack/tools/$1/go.sum" <(echo "$go_version" "$2") | sha256sum | cut -c1-12
}

build() {  # module-dir version ldflags name=package...
  local dir=$1 version=$2 ldflags=$3; shift 3
  local out
  out=$CACHE/tools/$dir-$version-$(key "$dir" "$ldflags")
  local missing=0
  for spec in "$@"; do [[ -x "$out/${spec%%=*}" ]] || missing=1; done
  if (( missing )); then
    echo "building $dir $version into $out" >&2
    local start=$SECONDS
    mkdir -p "$out.tmp"
    for spec in "$@"; do
      (cd "hack/tools/$dir" && go build -ldflags "$ldflags" -o "$out.tmp/${spec%%=*}" "${spec#*=}")
    done
    rm -rf "$out" && mv "$out.tmp" "$out"
    echo "built $dir in $((SECONDS - start)) s" >&2
  fi
  for spec in "$@"; do ln -sfn "$out/${spec%%=*}" "$BIN/${spec%%=*}"; done
}

k8s_minor=$(echo "$KUBERNETES_VERSION" | cut -d. -f2)
k8s_ldflags="-s -w -X k8s.io/component-base/version.gitVersion=${KUBERNETES_VERSION}"
k8s_ldflags+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=${k8s_minor}"
k8s_ldflags+=" -X k8s.io/component-base/version.gitTreeState=clean"
k8s_ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=${KUBERNETES_VERSION}"
k8s_ldflags+=" -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=${k8s_minor}"

# Smallest first, so a failure shows early.
build helm "$HELM_VERSION" "-s -w -X helm.sh/helm/v3/internal/version.version=${HELM_VERSION}" helm=helm.sh/helm/v3/cmd/helm
build etcd "$ETCD_VERSION" "-s -w" etcd=go.etcd.io/etcd/server/v3
build kwok "$KWOK_VERSION" "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION}" kwok=sigs.k8s.io/kwok/cmd/kwok
build kubernetes "$KUBERNETES_VERSION" "$k8s_ldflags" \
  kube-apiserver=k8s.io/kubernetes/cmd/kube-apiserver \
  kube-controller-manager=k8s.io/kubernetes/cmd/kube-controller-manager \
  kube-scheduler=k8s.io/kubernetes/cmd/kube-scheduler kubectl=k8s.io/kubernetes/cmd/kubectl
echo "$BIN"
