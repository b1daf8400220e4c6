#!/usr/bin/env bash
# Debian packages Corral's tests and tools need (idempotent; only installs what is missing).
set -euo pipefail
PACKAGES=(prometheus)  # prometheus + promtool: dashboard query checks and the dashboards e2e
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
