#!/bin/sh
# Print the path of a Python >= 3.12 (jax 0.12 needs it): first on PATH, then
# in pyenv's versions folder. Exit 1 with instructions when there is none.
ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }

for name in python3.12 python3.13 python3.14 python3 python; do
    p=$(command -v "$name" 2>/dev/null) || continue
    if ok "$p"; then echo "$p"; exit 0; fi
done

root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
for p in $(ls -d "$root"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -V); do
    if ok "$p"; then echo "$p"; exit 0; fi
done

echo "qarray needs Python >= 3.12 and found none on PATH or under $root/versions." >&2
echo "Install one, e.g. 'pyenv install 3.12' or your system's python3.12 package." >&2
exit 1
