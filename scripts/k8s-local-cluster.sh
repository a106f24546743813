#!/usr/bin/env bash
# A genuine Kubernetes control plane on 127.0.0.1, for the kubernetes runtime's tests.
#
#   k8s-local-cluster.sh build        build (once) and cache kube-apiserver, kube-controller-manager,
#                                     kube-scheduler and etcd; a cached build is reused
#   k8s-local-cluster.sh up DIR       start etcd, the apiserver (token auth, RBAC), the controller-
#                                     manager and the scheduler on free loopback ports; writes
#                                     DIR/kubeconfig (context "resoluto-local"), DIR/env, DIR/pids
#   k8s-local-cluster.sh down DIR     stop exactly the processes `up DIR` started (recorded pids)
#   k8s-local-cluster.sh env DIR      print DIR/env (KUBECONFIG=..., RESOLUTO_K8S_*)
#   k8s-local-cluster.sh status       print the cache directory if the build is there (exit 1 if not)
#
# With RESOLUTO_K8S_OWNER_PID set, `up` also leaves a watchdog that runs `down` once that
# process is gone (a test session killed before its teardown).
#
# Source: Debian bookworm's `kubernetes` source package (the full upstream v1.20.2 tree with
# vendor/), built offline with Debian's Go 1.19 after one vendored library (reflect2, which crashes
# the apiserver under Go >= 1.18) is swapped for Debian's newer copy. etcd is Debian's etcd-server,
# unpacked (its postinst would start a system service). No kubelet: tests/support/k8s_node_agent.py plays it.
set -euo pipefail

PKG_VERSION="1.20.5+really1.20.2-1.1+deb12u1"
REFLECT2_VERSION="1.0.2-2"
CACHE="${RESOLUTO_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/prefect-resoluto/k8s-v1.20.2}"
BINS=(kube-apiserver kube-controller-manager kube-scheduler etcd)
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi

log() { printf 'k8s-local-cluster: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

have_build() {
  [ "$(cat "$CACHE/VERSION" 2>/dev/null || true)" = "$PKG_VERSION" ] || return 1
  for b in "${BINS[@]}"; do [ -x "$CACHE/bin/$b" ] || return 1; done
}

add_deb_src() {
  # A sources file of our own for bookworm's source packages; the system's files are left alone.
  local f=/etc/apt/sources.list.d/resoluto-deb-src.sources mirror
  [ -f "$f" ] && return 0
  mirror=$(sed -n 's/^URIs: *\(http[^ ]*debian\)\/* *$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1)
  [ -n "$mirror" ] || mirror=http://deb.debian.org/debian
  $SUDO tee "$f" >/dev/null <<SRC
Types: deb-src
URIs: ${mirror}
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
}

cmd_build() {
  if have_build; then log "cached build in $CACHE (kubernetes $PKG_VERSION)"; return 0; fi
  # Two set-ups on one machine (parallel worktrees) must not build into the same tree at once.
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.build.lock"
  flock 9
  if have_build; then log "cached build in $CACHE (kubernetes $PKG_VERSION), made meanwhile"; return 0; fi
  grep -q bookworm /etc/os-release 2>/dev/null || die "the build needs Debian bookworm's kubernetes source package"
  local t0 work
  t0=$(date +%s)
  add_deb_src
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    golang-1.19-go rsync jq make dpkg-dev >/dev/null
  mkdir -p "$CACHE"
  work="$CACHE/build"
  rm -rf "$work"; mkdir -p "$work"
  chmod 755 "$work"
  (
    cd "$work"
    # apt's download sandbox user must be able to write here; fall back to root's own download.
    apt-get source --download-only -qq "kubernetes=$PKG_VERSION" >/dev/null 2>&1 \
      || die "apt-get source kubernetes=$PKG_VERSION failed (is a bookworm deb-src entry reachable?)"
    dpkg-source -x -q "kubernetes_${PKG_VERSION}.dsc" k8s >/dev/null
    apt-get download -qq "golang-github-modern-go-reflect2-dev=$REFLECT2_VERSION" "etcd-server" >/dev/null 2>&1 \
      || die "apt-get download of reflect2/etcd-server failed"
    dpkg-deb -x golang-github-modern-go-reflect2-dev_*.deb reflect2
    dpkg-deb -x etcd-server_*.deb etcd
    r2=k8s/vendor/github.com/modern-go/reflect2
    rm -f "$r2"/*.go "$r2"/*.s
    cp reflect2/usr/share/gocode/src/github.com/modern-go/reflect2/*.go "$r2"/
    cp reflect2/usr/share/gocode/src/github.com/modern-go/reflect2/*.s "$r2"/ 2>/dev/null || true
    mkdir -p home
    cd k8s
    PATH=/usr/lib/go-1.19/bin:$PATH CGO_ENABLED=0 HOME="$work/home" GOFLAGS= GO111MODULE=off \
      make WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler" GOLDFLAGS='-s -w' \
      >"$work/make.log" 2>&1 || { tail -n 40 "$work/make.log" >&2; die "make failed (log: $work/make.log)"; }
  )
  mkdir -p "$CACHE/bin"
  for b in kube-apiserver kube-controller-manager kube-scheduler; do
    cp "$work/k8s/_output/bin/$b" "$CACHE/bin/$b"
  done
  cp "$work/etcd/usr/bin/etcd" "$CACHE/bin/etcd"
  echo "$PKG_VERSION" >"$CACHE/VERSION"
  rm -rf "$work"
  log "built kubernetes $PKG_VERSION in $(( $(date +%s) - t0 )) s -> $CACHE/bin"
}

cmd_status() {
  have_build || { echo "no cached build in $CACHE"; return 1; }
  echo "$CACHE"
}

free_ports() {
  # N distinct free loopback ports, held open together so they cannot repeat.
  python3 - "$1" <<'PY'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

start() {  # start NAME CMD...: detached, logged, pid recorded
  local name=$1; shift
  setsid "$@" >"$DIR/logs/$name.log" 2>&1 </dev/null &
  echo "$name $!" >>"$DIR/pids"
}

wait_for() {  # wait_for WHAT SECONDS CMD...
  local what=$1 limit=$2; shift 2
  local end=$(( $(date +%s) + limit ))
  until "$@" >/dev/null 2>&1; do
    if [ "$(date +%s)" -ge "$end" ]; then
      log "$what not ready after ${limit}s; last log lines:"; tail -n 20 "$DIR/logs/"*.log >&2 || true
      cmd_down; exit 1
    fi
    check_alive
    sleep 0.2
  done
}

check_alive() {
  local name pid
  while read -r name pid; do
    kill -0 "$pid" 2>/dev/null || { log "$name (pid $pid) exited:"; tail -n 30 "$DIR/logs/$name.log" >&2; cmd_down; exit 1; }
  done <"$DIR/pids"
}

cmd_up() {
  have_build || die "no cached build in $CACHE: run '$0 build' first (scripts/setup.sh does)"
  [ -n "$DIR" ] || die "usage: $0 up DIR"
  if [ -s "$DIR/pids" ]; then die "$DIR/pids exists: a cluster is already up there ('$0 down $DIR' first)"; fi
  local t0 ports etcd_c etcd_p api cm sch token bin="$CACHE/bin"
  t0=$(date +%s.%N)
  mkdir -p "$DIR/logs" "$DIR/certs"
  DIR=$(cd "$DIR" && pwd)
  # etcd fsyncs every write: on tmpfs when there is one (a test cluster keeps nothing).
  if [ -d /dev/shm ] && [ -w /dev/shm ]; then
    ln -sfn "$(mktemp -d /dev/shm/resoluto-etcd.XXXXXX)" "$DIR/etcd"
  else
    mkdir -p "$DIR/etcd"
  fi
  : >"$DIR/pids"
  read -r etcd_c etcd_p api cm sch <<<"$(free_ports 5)"
  token=$(openssl rand -hex 24)
  echo "$token,admin,uid-admin,system:masters" >"$DIR/tokens.csv"
  chmod 600 "$DIR/tokens.csv"
  openssl genrsa -out "$DIR/sa.key" 2048 2>/dev/null
  openssl rsa -in "$DIR/sa.key" -pubout -out "$DIR/sa.pub" 2>/dev/null
  start etcd "$bin/etcd" --name default --data-dir "$DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_c" --advertise-client-urls "http://127.0.0.1:$etcd_c" \
    --listen-peer-urls "http://127.0.0.1:$etcd_p" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_p" \
    --initial-cluster "default=http://127.0.0.1:$etcd_p" \
    --quota-backend-bytes=1073741824
  wait_for etcd 60 curl -fsS "http://127.0.0.1:$etcd_c/health"
  start kube-apiserver "$bin/kube-apiserver" --etcd-servers="http://127.0.0.1:$etcd_c" \
    --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$api" --insecure-port=0 \
    --cert-dir="$DIR/certs" --token-auth-file="$DIR/tokens.csv" --authorization-mode=Node,RBAC \
    --service-account-issuer=https://kubernetes.default.svc --service-account-key-file="$DIR/sa.pub" \
    --service-account-signing-key-file="$DIR/sa.key" --service-cluster-ip-range=10.0.0.0/24 \
    --endpoint-reconciler-type=none --kubelet-preferred-address-types=InternalIP \
    --allow-privileged=false --profiling=false
  wait_for kube-apiserver 120 curl -fsS --cacert "$DIR/certs/apiserver.crt" -H "Authorization: Bearer $token" "https://127.0.0.1:$api/readyz"
  cat >"$DIR/kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: resoluto-local
  cluster:
    server: https://127.0.0.1:$api
    certificate-authority: $DIR/certs/apiserver.crt
users:
- name: admin
  user:
    token: $token
contexts:
- name: resoluto-local
  context:
    cluster: resoluto-local
    user: admin
current-context: resoluto-local
KC
  chmod 600 "$DIR/kubeconfig"
  start kube-controller-manager "$bin/kube-controller-manager" --kubeconfig="$DIR/kubeconfig" \
    --leader-elect=false --bind-address=127.0.0.1 --port=0 --secure-port="$cm" \
    --service-account-private-key-file="$DIR/sa.key" --root-ca-file="$DIR/certs/apiserver.crt" \
    --use-service-account-credentials=false --controllers='*,-nodeipam' --profiling=false
  start kube-scheduler "$bin/kube-scheduler" --kubeconfig="$DIR/kubeconfig" \
    --leader-elect=false --bind-address=127.0.0.1 --port=0 --secure-port="$sch" --profiling=false
  wait_for kube-controller-manager 60 curl -fsSk "https://127.0.0.1:$cm/healthz"
  wait_for kube-scheduler 60 curl -fsSk "https://127.0.0.1:$sch/healthz"
  cat >"$DIR/env" <<ENV
KUBECONFIG=$DIR/kubeconfig
RESOLUTO_K8S_CONTEXT=resoluto-local
RESOLUTO_K8S_SERVER=https://127.0.0.1:$api
RESOLUTO_K8S_TOKEN=$token
RESOLUTO_K8S_CA=$DIR/certs/apiserver.crt
RESOLUTO_K8S_ETCD=http://127.0.0.1:$etcd_c
ENV
  if [ -n "${RESOLUTO_K8S_OWNER_PID:-}" ]; then
    # A test session killed before its teardown must not leave a control plane behind.
    setsid bash "$0" _watch "$DIR" "$RESOLUTO_K8S_OWNER_PID" >/dev/null 2>&1 </dev/null &
    echo $! >"$DIR/watchdog.pid"
  fi
  log "up in $(python3 -c "import sys; print(round($(date +%s.%N) - $t0, 1))") s: apiserver https://127.0.0.1:$api (kubeconfig $DIR/kubeconfig, context resoluto-local)"
}

cmd_watch() {
  local owner=$1
  while kill -0 "$owner" 2>/dev/null && [ -s "$DIR/pids" ]; do sleep 2; done
  rm -f "$DIR/watchdog.pid"
  cmd_down
}

cmd_down() {
  [ -n "$DIR" ] || die "usage: $0 down DIR"
  local name pid n
  if [ -f "$DIR/watchdog.pid" ]; then
    kill "$(cat "$DIR/watchdog.pid")" 2>/dev/null || true
    rm -f "$DIR/watchdog.pid"
  fi
  [ -f "$DIR/pids" ] || return 0
  # A pid is ours only while its command line still names our directory or cache (pids are
  # reused). All are told at once and given 1 s together, then killed: nothing here is kept
  # (one after another, each given 5 s, took a test session's teardown ~11 s).
  local ours=()
  while read -r name pid; do
    if tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -qF -e "$DIR" -e "$CACHE"; then
      ours+=("$pid")
    fi
  done < <(tac "$DIR/pids")
  if [ "${#ours[@]}" -gt 0 ]; then
    kill -TERM "${ours[@]}" 2>/dev/null || true
    for n in $(seq 10); do
      local alive=0
      for pid in "${ours[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
      [ "$alive" = 1 ] || break
      sleep 0.1
    done
    kill -KILL "${ours[@]}" 2>/dev/null || true
  fi
  rm -f "$DIR/pids"
  if [ -L "$DIR/etcd" ]; then rm -rf "$(readlink "$DIR/etcd")" "$DIR/etcd"; fi
}

DIR="${2:-}"
case "${1:-}" in
  build) cmd_build ;;
  status) cmd_status ;;
  up) cmd_up ;;
  down) cmd_down ;;
  env) cat "$DIR/env" ;;
  _watch) cmd_watch "$3" ;;
  *) die "usage: $0 build|status|up DIR|down DIR|env DIR" ;;
esac
