#!/usr/bin/env bash
# Install the external tools the tests need: prometheus, promtool, alertmanager, amtool (Debian
# packages prometheus and prometheus-alertmanager), Chromium for the status-page test, openssl
# for throwaway TLS certificates, and the npm packages of dashboards/check.
# Idempotent: every step is skipped when its tool is already present. Meant for a fresh
# Debian machine as root; `make test` calls it before the test suite.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
check_dir="$repo_root/dashboards/check"

log() { printf 'install-tools: %s\n' "$*"; }

# Debian: promtool comes with `prometheus`, amtool with `prometheus-alertmanager`.
apt_packages=()
command -v promtool >/dev/null 2>&1 || apt_packages+=(prometheus)
command -v amtool >/dev/null 2>&1 || apt_packages+=(prometheus-alertmanager)
command -v npm >/dev/null 2>&1 || apt_packages+=(nodejs npm)
command -v chromium >/dev/null 2>&1 || apt_packages+=(chromium)
command -v openssl >/dev/null 2>&1 || apt_packages+=(openssl)

if ((${#apt_packages[@]} > 0)); then
    if ! command -v apt-get >/dev/null 2>&1; then
        log "missing ${apt_packages[*]} and apt-get is not available: install them by hand" >&2
        exit 1
    fi
    if [[ $(id -u) -ne 0 ]]; then
        log "missing ${apt_packages[*]}: run this script as root to install them" >&2
        exit 1
    fi
    # The packages' postinst would start prometheus/alertmanager daemons; we only want the
    # binaries, so deny service starts unless the machine already has a policy of its own.
    created_policy=""
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        created_policy=1
    fi
    log "installing Debian packages: ${apt_packages[*]}"
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${apt_packages[@]}"
    if [[ -n $created_policy ]]; then
        rm -f /usr/sbin/policy-rc.d
    fi
else
    log "prometheus, alertmanager, chromium, openssl and npm already present"
fi

# npm packages for the dashboard schema check (@grafana/schema, typescript).
# npm records what it installed in node_modules/.package-lock.json; a newer lock file means the
# pinned versions changed since, so install again.
if [[ -x "$check_dir/node_modules/.bin/tsc" && -d "$check_dir/node_modules/@grafana/schema" &&
    ! "$check_dir/package-lock.json" -nt "$check_dir/node_modules/.package-lock.json" ]]; then
    log "dashboards/check node_modules already present"
else
    log "installing npm packages in dashboards/check"
    if [[ -f "$check_dir/package-lock.json" ]]; then
        (cd "$check_dir" && npm ci --no-audit --no-fund)
    else
        (cd "$check_dir" && npm install --no-audit --no-fund)
    fi
fi
