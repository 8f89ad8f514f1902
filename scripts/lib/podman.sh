# shellcheck shell=bash
# Podman for sandman, idempotent: Debian's podman, a rootful API service and a rootless one (for a
# dedicated unprivileged user), both answering docker-py's compat API, and sandman's agent image
# loaded into both storages. Sourced by scripts/setup, which defines say, die, as_root, apt_install.
#
# No systemd/logind is assumed: the services are plain background processes (setsid), and root
# prepares the rootless user's XDG_RUNTIME_DIR. A service whose socket answers is never restarted.
#
#   rootful socket   $SANDMAN_PODMAN_SOCK           (default /run/podman/podman.sock)
#   rootless user    $SANDMAN_PODMAN_USER           (default sandman-podman, a system user)
#   rootless socket  /run/user/<uid>/podman/podman.sock
#   logs             /var/log/sandman-podman.log, /var/log/sandman-podman-rootless.log
#
# Usage: setup_podman [IMAGE...]   (default: the newest local sandman/base image in Docker)
SANDMAN_PODMAN_SOCK_DEFAULT=/run/podman/podman.sock
SANDMAN_PODMAN_USER_DEFAULT=sandman-podman
SANDMAN_PODMAN_SUBID_COUNT=65536
SANDMAN_PODMAN_STORAGE_CONF='[storage]
driver = "overlay"'

# True if an API service answers on the Unix socket $1 (GET /_ping).
_podman_answers() {
    [ -S "$1" ] && as_root curl -fsS --max-time 3 --unix-socket "$1" http://podman/_ping >/dev/null 2>&1
}

# Wait up to ~30s for socket $1 to answer.
_podman_wait() {
    local _
    for _ in $(seq 1 150); do _podman_answers "$1" && return 0; sleep 0.2; done
    return 1
}

# Run podman as the rootless user, with the environment a login session would have given it.
_podman_as_user() {
    local user=$1 uid home
    shift
    uid=$(id -u "$user") home=$(getent passwd "$user" | cut -d: -f6)
    as_root runuser -u "$user" -- env -i -C / HOME="$home" USER="$user" LOGNAME="$user" \
        XDG_RUNTIME_DIR="/run/user/$uid" PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin \
        podman "$@"
}

# First free start for a subordinate id range: past every range already in /etc/subuid and /etc/subgid.
_podman_free_subid() {
    cat /etc/subuid /etc/subgid 2>/dev/null | awk -F: -v min=100000 '
        NF >= 3 && $2 ~ /^[0-9]+$/ && $3 ~ /^[0-9]+$/ { end = $2 + $3; if (end > min) min = end }
        END { print min }'
}

setup_podman() {
    local sock=${SANDMAN_PODMAN_SOCK:-$SANDMAN_PODMAN_SOCK_DEFAULT}
    local user=${SANDMAN_PODMAN_USER:-$SANDMAN_PODMAN_USER_DEFAULT}
    local uid home rsock start images=("$@") image pkgs=()

    # 1. Packages: podman (runc, conmon, containers-common come with it) and newuidmap/newgidmap.
    # fuse-overlayfs is not needed: kernels >= 5.13 do rootless overlay natively.
    command -v podman >/dev/null || pkgs+=(podman)
    command -v newuidmap >/dev/null || pkgs+=(uidmap)
    command -v curl >/dev/null || pkgs+=(curl)
    if [ ${#pkgs[@]} -gt 0 ]; then
        say "installing Debian's ${pkgs[*]}"
        apt_install "${pkgs[@]}"
    fi

    # 2. Rootful API service.
    if _podman_answers "$sock"; then
        say "podman rootful service answers on $sock"
    else
        say "starting podman rootful service on $sock (log: /var/log/sandman-podman.log)"
        as_root mkdir -p "$(dirname "$sock")"
        as_root rm -f "$sock"
        as_root setsid -f sh -c 'exec podman system service --time=0 "unix://$1" </dev/null >>/var/log/sandman-podman.log 2>&1' \
            sh "$sock" </dev/null >/dev/null 2>&1
        _podman_wait "$sock" || die "podman rootful service did not answer on $sock (see /var/log/sandman-podman.log)"
    fi

    # 3. The rootless user, its subordinate ids and its runtime dir.
    if ! id -u "$user" >/dev/null 2>&1; then
        say "creating user $user (rootless podman)"
        as_root useradd --system --user-group --create-home --home-dir "/var/lib/$user" \
            --shell /usr/sbin/nologin --comment "sandman rootless podman" "$user"
    fi
    uid=$(id -u "$user") home=$(getent passwd "$user" | cut -d: -f6)
    if ! grep -q "^$user:" /etc/subuid 2>/dev/null || ! grep -q "^$user:" /etc/subgid 2>/dev/null; then
        start=$(_podman_free_subid)
        say "giving $user subordinate ids $start-$((start + SANDMAN_PODMAN_SUBID_COUNT - 1))"
        grep -q "^$user:" /etc/subuid 2>/dev/null \
            || as_root usermod --add-subuids "$start-$((start + SANDMAN_PODMAN_SUBID_COUNT - 1))" "$user"
        grep -q "^$user:" /etc/subgid 2>/dev/null \
            || as_root usermod --add-subgids "$start-$((start + SANDMAN_PODMAN_SUBID_COUNT - 1))" "$user"
    fi
    # Rootless storage on overlay (native on kernels >= 5.13): without a storage.conf podman 4.3
    # picks vfs, which copies every layer for every container (about 10x slower to start).
    if [ "$(cat "$home/.config/containers/storage.conf" 2>/dev/null)" != "$SANDMAN_PODMAN_STORAGE_CONF" ]; then
        say "configuring $user's podman storage: overlay"
        as_root install -d -m 0700 -o "$uid" -g "$(id -g "$user")" "$home/.config" "$home/.config/containers"
        printf '%s\n' "$SANDMAN_PODMAN_STORAGE_CONF" | as_root tee "$home/.config/containers/storage.conf" >/dev/null
        as_root chown "$uid:$(id -g "$user")" "$home/.config/containers/storage.conf"
    fi
    # What logind would do: /run/user/<uid>, owned by the user, mode 0700.
    if [ "$(stat -c '%u %a' "/run/user/$uid" 2>/dev/null)" != "$uid 700" ]; then
        as_root install -d -m 0755 /run/user
        as_root install -d -m 0700 -o "$uid" -g "$(id -g "$user")" "/run/user/$uid"
    fi

    # 4. Rootless API service (root can connect to it: root passes the socket's permissions).
    rsock="/run/user/$uid/podman/podman.sock"
    if _podman_answers "$rsock"; then
        say "podman rootless service ($user) answers on $rsock"
    else
        say "starting podman rootless service ($user) on $rsock (log: /var/log/sandman-podman-rootless.log)"
        as_root touch /var/log/sandman-podman-rootless.log
        as_root chown "$uid" /var/log/sandman-podman-rootless.log
        as_root rm -f "$rsock"
        # A storage made with vfs (before the storage.conf above) cannot be switched in place: it
        # is sandman's own user's, so reset it (its images are reloaded below).
        if as_root test -d "$home/.local/share/containers/storage/vfs"; then
            say "resetting $user's vfs storage (switching to overlay)"
            _podman_as_user "$user" system reset -f >/dev/null 2>&1 || die "podman system reset failed ($user)"
        fi
        # Stop a stale pause process (its user namespace) from an earlier boot or service.
        _podman_as_user "$user" system migrate >/dev/null 2>&1 || true
        as_root install -d -m 0700 -o "$uid" -g "$(id -g "$user")" "$(dirname "$rsock")"
        as_root setsid -f runuser -u "$user" -- env -i -C / HOME="$home" USER="$user" LOGNAME="$user" \
            XDG_RUNTIME_DIR="/run/user/$uid" PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin \
            sh -c 'exec podman system service --time=0 "unix://$1" </dev/null >>/var/log/sandman-podman-rootless.log 2>&1' \
            sh "$rsock" </dev/null >/dev/null 2>&1
        _podman_wait "$rsock" || die "podman rootless service did not answer on $rsock (see /var/log/sandman-podman-rootless.log)"
    fi

    # 5. The agent image in both storages, copied from Docker's (no registry involved).
    if [ ${#images[@]} -eq 0 ]; then
        image=$(docker images sandman/base --format '{{.Repository}}:{{.Tag}}' 2>/dev/null | grep -v '<none>' | head -n1 || true)
        [ -n "$image" ] || { say "no sandman/base image in Docker yet: nothing to load into podman"; return 0; }
        images=("$image")
    fi
    for image in "${images[@]}"; do
        docker image inspect "$image" >/dev/null 2>&1 || die "image $image is not in Docker: build it first"
        if as_root podman image exists "$image"; then
            say "podman (rootful) has $image"
        else
            say "loading $image into podman (rootful)"
            docker save "$image" | as_root podman load -q >/dev/null || die "podman load of $image failed (rootful)"
        fi
        if _podman_as_user "$user" image exists "$image"; then
            say "podman (rootless, $user) has $image"
        else
            say "loading $image into podman (rootless, $user)"
            docker save "$image" | _podman_as_user "$user" load -q >/dev/null \
                || die "podman load of $image failed (rootless, $user)"
        fi
    done
}
