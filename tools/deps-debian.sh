#!/bin/sh
# Installs the build dependencies from Debian (or Ubuntu) packages. Uses sudo when not root.
set -e
SUDO=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends \
    build-essential cmake pkg-config ca-certificates \
    libpcre2-dev libutf8proc-dev libjansson-dev libssl-dev libevent-dev >/dev/null
echo "deps-debian: build dependencies installed"
