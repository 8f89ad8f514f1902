# shellcheck shell=bash
# gVisor for sandman, idempotent: Debian's runsc, registered as the Docker runtime "runsc", and the
# serving dockerd told about it by SIGHUP (it reloads `runtimes` without a restart: no running
# container is touched). Sourced by scripts/setup, which defines say, die, as_root, apt_install.
#
# The runtime arguments are what Debian's runsc (0.0~20221219) needs on this kind of host:
#   --network=none   it refuses any other network on kernels >= 6.11 ("cannot run with network
#                    enabled in root network namespace": it misreads the kernel); sandman's
#                    containers have NetworkMode none anyway.
#   --host-uds=all   the sandbox both connects to host Unix sockets in bind mounts (the upcall
#                    relay: needs "open") and creates sockets there that the host connects to
#                    (the supervisor's control socket: needs "create"); either alone breaks one.
# Not --oci-seccomp (without it the container's seccomp profile is accepted but NOT enforced):
# this runsc turns every refusal into EPERM, so the shipped profile's clone3 -> ENOSYS rule
# becomes EPERM and pthread_create fails; add it with a runsc variant of the profile.
# Read by `setup_gvisor` only: override with SANDMAN_RUNSC_ARGS (space-separated) if needed.
SANDMAN_RUNSC_ARGS_DEFAULT="--network=none --host-uds=all"

setup_gvisor() {
    local conf=/etc/docker/daemon.json runsc_path args state pid want
    if ! command -v runsc >/dev/null; then
        say "installing Debian's runsc (gVisor)"
        apt_install runsc
    fi
    runsc_path=$(command -v runsc) || die "runsc is not on PATH after installing it"
    read -r -a args <<<"${SANDMAN_RUNSC_ARGS:-$SANDMAN_RUNSC_ARGS_DEFAULT}"

    # Merge {"runtimes": {"runsc": ...}} into daemon.json, keeping every other key; write only on
    # a change (atomically). Prints "changed" or "same".
    state=$(as_root python3 - "$conf" "$runsc_path" "${args[@]}" <<'PY'
import json, os, sys
conf, path, args = sys.argv[1], sys.argv[2], sys.argv[3:]
try:
    with open(conf, encoding="utf-8") as f:
        text = f.read()
except FileNotFoundError:
    text = ""
try:
    data = json.loads(text) if text.strip() else {}
except ValueError as exc:
    sys.exit(f"{conf} is not valid JSON ({exc}): fix it by hand first")
if not isinstance(data, dict) or not isinstance(data.get("runtimes", {}), dict):
    sys.exit(f"{conf}: unexpected structure (want an object with an object 'runtimes')")
want = {"path": path, "runtimeArgs": args}
if data.get("runtimes", {}).get("runsc") == want:
    print("same")
    sys.exit(0)
data.setdefault("runtimes", {})["runsc"] = want
os.makedirs(os.path.dirname(conf), exist_ok=True)
tmp = f"{conf}.sandman-{os.getpid()}"
with open(tmp, "w", encoding="utf-8") as f:
    json.dump(data, f, indent=2)
    f.write("\n")
mode = os.stat(conf).st_mode & 0o777 if os.path.exists(conf) else 0o644
os.chmod(tmp, mode)
os.replace(tmp, conf)
print("changed")
PY
    ) || die "could not register runsc in $conf"
    [ "$state" = changed ] && say "registered runtime runsc in $conf (${args[*]})"

    # The serving engine: only a local dockerd can be told to reload (its pid file, else the one
    # dockerd process). None running: the file is enough, it is read at the next start.
    pid=$(cat /var/run/docker.pid 2>/dev/null || true)
    if [ -z "$pid" ] || ! [ -e "/proc/$pid" ] || [ "$(cat "/proc/$pid/comm" 2>/dev/null)" != dockerd ]; then
        pid=$(pgrep -x dockerd || true)
        [ "$(printf '%s\n' "$pid" | grep -c .)" = 1 ] || pid=""
    fi
    if [ -z "$pid" ]; then
        say "no (single) local dockerd found: runsc is registered for its next start"
        return 0
    fi
    want=$(python3 -c 'import json,sys; print(json.dumps({"path": sys.argv[1], "runtimeArgs": sys.argv[2:]}, sort_keys=True))' \
        "$runsc_path" "${args[@]}")
    _gvisor_loaded() {
        docker info --format '{{json .Runtimes.runsc}}' 2>/dev/null \
            | python3 -c 'import json,sys; t=sys.stdin.read().strip(); print(json.dumps(json.loads(t), sort_keys=True) if t and t != "null" else "")' 2>/dev/null
    }
    [ "$(_gvisor_loaded)" = "$want" ] && return 0
    say "reloading dockerd's configuration (SIGHUP to pid $pid, no restart)"
    as_root kill -HUP "$pid"
    for _ in $(seq 1 50); do
        [ "$(_gvisor_loaded)" = "$want" ] && { say "dockerd knows runtime runsc"; return 0; }
        sleep 0.1
    done
    die "dockerd did not pick up runtime runsc after SIGHUP (see its log; is $conf valid for it?)"
}
