#!/bin/sh
# Headless Chromium for tests/tesseract/test_docs_page.py (the served /docs
# page rendered offline). Installs Debian's `chromium` when it is missing and
# this is root on Debian; otherwise says what to install.
set -eu
for name in chromium chromium-browser; do
    if command -v "$name" >/dev/null 2>&1; then exit 0; fi
done
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's chromium (headless checks of the served /docs page)"
    apt-get install -y -q chromium >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
    exit 0
fi
echo "make test needs headless Chromium for the /docs page check: install your" >&2
echo "system's chromium package (Debian/Ubuntu: apt-get install chromium)." >&2
exit 1
