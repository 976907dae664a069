#!/usr/bin/env bash
# Prints a command that runs Python >= 3.12 (JAX 0.11 needs it), or fails saying how to get one.
set -u
for candidate in python3.12 python3.13 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
        "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
        echo "$candidate"; exit 0
    fi
done
if command -v pyenv >/dev/null 2>&1; then
    version=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]\.[0-9]+$' | sort -V | head -1)
    if [ -n "$version" ]; then
        echo "env PYENV_VERSION=$version python3"; exit 0
    fi
fi
echo "error: jaxllm needs Python >= 3.12; install it (e.g. pyenv install 3.12) and retry" >&2
exit 1
