#!/usr/bin/env bash
# Wheels the lent GPU machine lacks (it has torch, triton, transformers, pytest, but no
# network): downloaded here into .whl/ (git-ignored), carried with the device call, and
# installed there with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
# Versions follow what scripts/install.sh put in .venv, so both machines run the same code.
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS=(fastapi starlette uvicorn httpx2 httpcore2 h11 truststore pydantic pydantic-core annotated-types annotated-doc
      typing-inspection opentelemetry-api llguidance openai distro jiter sniffio anthropic
      docstring-parser
      jsonschema referencing rpds-py jsonschema-specifications mlx mlx-cpu mlx-lm)
pins=()
for p in "${PKGS[@]}"; do
    v=$(.venv/bin/python -m pip show "$p" 2>/dev/null | awk "/^Version:/{print \$2}" || true)
    pins+=("$p${v:+==$v}")
done
plat=()
for t in manylinux_2_{17,27,28,31,35}_x86_64 manylinux2014_x86_64 any; do plat+=(--platform "$t"); done
mkdir -p .whl
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -d .whl "${pins[@]}"
du -sh .whl
# every wheel named above must be there (a missing one showed only as 18 server-test errors)
missing=()
for p in "${PKGS[@]}"; do
    n=${p//-/_}
    compgen -G ".whl/${n}-*.whl" > /dev/null || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] || { echo "missing wheels: ${missing[*]}" >&2; exit 1; }
