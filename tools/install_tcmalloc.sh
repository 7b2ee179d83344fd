#!/usr/bin/env bash
# Puts tcmalloc (Debian's libtcmalloc-minimal4) into VENV/lib, where paratrain's CPU ranks find it
# (paratrain/host_memory.py), unless the system already has it. Best effort: without apt or the
# package, paratrain runs with glibc's allocator and says nothing is lost but speed.
set -u
venv=${1:?usage: install_tcmalloc.sh VENV}
python=$venv/bin/python
if "$python" -c 'import sys; from paratrain.host_memory import allocator_library as a; sys.exit(a() is None)' 2>/dev/null; then
    exit 0
fi
command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || {
    echo "tcmalloc not found and no apt-get here: CPU runs use glibc's allocator (slower; see README, Host memory)"; exit 0; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fetch() {
    for package in libtcmalloc-minimal4t64 libtcmalloc-minimal4; do
        (cd "$work" && apt-get download -q "$package" >/dev/null 2>&1) && return 0
    done
    return 1
}
if ! fetch && [ "$(id -u)" = 0 ]; then
    apt-get update -qq >/dev/null 2>&1 && fetch
fi
deb=$(ls "$work"/*.deb 2>/dev/null | head -n 1)
if [ -z "$deb" ]; then
    echo "could not fetch Debian's libtcmalloc-minimal4: CPU runs use glibc's allocator (slower; see README, Host memory)"
    exit 0
fi
dpkg-deb -x "$deb" "$work/root"
cp -P "$work"/root/usr/lib/*/libtcmalloc_minimal.so.4* "$venv/lib/"
echo "tcmalloc installed into $venv/lib"
