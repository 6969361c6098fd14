#!/usr/bin/env bash
# System packages the tests need beyond Python: Chromium and its WebDriver
# (Debian's, so Selenium never downloads a browser) for the status page's
# browser test, and bubblewrap for the workers' executor sandbox. Idempotent:
# installs only what is missing. Needs root (CI runs as root); elsewhere run
# it with sudo or install the packages yourself.
set -euo pipefail
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
[ -x /usr/bin/chromedriver ] || missing+=(chromium-driver)
# bubblewrap: the workers' executor sandbox (worker.jobs.sandbox = "auto"/"bwrap", docs/security.md).
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
