#!/usr/bin/env bash
# Build a local stand-in for python:3.11-slim-bookworm from Debian's packages,
# for machines that reach Debian's mirror but no image registry.
#
# debootstrap (minbase) + python3 (3.11 in bookworm) + python3-venv, trimmed
# like the official slim image, then `docker import`. The Dockerfile only
# needs `python3 -m venv` and `useradd`, which both images have, so the
# stand-in goes in through the same build arg:
#   docker build --build-arg BASE_IMAGE=hypha-base:3.11-slim-bookworm ...
# Idempotent: does nothing when the tag exists (HYPHA_BASE_REBUILD=1 forces).
set -euo pipefail
tag=${HYPHA_BASE_IMAGE:-hypha-base:3.11-slim-bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if [ -z "${HYPHA_BASE_REBUILD:-}" ] && docker image inspect "$tag" >/dev/null 2>&1; then
  echo "base image $tag exists"
  exit 0
fi
if ! command -v debootstrap >/dev/null; then
  [ "$(id -u)" = 0 ] || { echo "debootstrap is missing: apt-get install debootstrap (as root)" >&2; exit 1; }
  apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null
fi
[ "$(id -u)" = 0 ] || { echo "debootstrap needs root" >&2; exit 1; }

rootfs=$(mktemp -d /tmp/hypha-base.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
echo "debootstrap bookworm (minbase + python3) into $rootfs ..."
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || { tail -20 "$rootfs.log" >&2; exit 1; }
rm -f "$rootfs.log"
# What the official slim image leaves out: package lists, docs, man pages, locales.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/var/cache/debconf/*-old \
  "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
  "$rootfs"/var/log/*.log "$rootfs"/tmp/*
find "$rootfs"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} +
tar --numeric-owner -C "$rootfs" -c . | docker import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python3"]' \
  --message "stand-in for python:3.11-slim-bookworm (debootstrap minbase + python3)" \
  - "$tag" >/dev/null
echo "built $tag ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}'))"
