#!/usr/bin/env bash
# The Python client stage of scripts/test.sh: installs client/python the way the README documents
# (a venv with Debian's packages visible, pip offline) into a throwaway folder, runs its pytest suite
# against real fusedlayer_server processes and runs examples/whole_model.py on the CPU backend.
#
#   scripts/test-python.sh [BUILD_DIR]        (default build/; needs BUILD_DIR/server/fusedlayer_server and
#                                              BUILD_DIR/client/fusedctl, whose import-checkpoint the tests
#                                              compare fusedlayer.import_checkpoint with)
#
# Runs with Debian's /usr/bin/python3 on purpose: a pyenv python3 on PATH lacks python3-grpcio,
# python3-protobuf, python3-numpy, python3-pytest, python3-torch and mypy. Any failure (pytest exit 5, "no tests
# collected", included) stops the script with a non-zero exit.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$(cd "${1:-$ROOT/build}" && pwd)"  # absolute: the tests run from another folder
SERVER="$BUILD/server/fusedlayer_server"
[ -x "$SERVER" ] || { echo "test-python: no server binary at $SERVER" >&2; exit 1; }
[ -x "$BUILD/client/fusedctl" ] || { echo "test-python: no fusedctl at $BUILD/client/fusedctl" >&2; exit 1; }

VENV="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$VENV")"' EXIT
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# The README's install command, verbatim apart from the venv's location.
/usr/bin/python3 -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install --no-index --no-build-isolation "$ROOT/client/python"

# Run from outside the source tree so `import fusedlayer` can only find the installed package
# (the source folder lacks the generated stubs).
cd "$(dirname "$VENV")"

# Type check of the installed package (its annotations, py.typed and the generated message stubs),
# with Debian's mypy against the venv's site-packages; any error fails the stage.
/usr/bin/python3 -m mypy --config-file "$ROOT/client/python/pyproject.toml" --python-executable "$VENV/bin/python" \
  --no-incremental -p fusedlayer || { echo "test-python: mypy found errors" >&2; exit 1; }
"$VENV/bin/python" -c 'import importlib.resources as r; assert r.files("fusedlayer").joinpath("py.typed").is_file()' \
  || { echo "test-python: the installed package has no py.typed" >&2; exit 1; }
# A user's code checked with --strict against the installed package: py.typed is honoured and the
# public names are exported (a strict checker rejects implicitly re-exported ones).
cat > typed_use.py <<'PY'
import fusedlayer
import fusedlayer.aio


def seam_rows(c: fusedlayer.Client) -> int:
    r: fusedlayer.MhcSeamResult = c.mhc_seam("v41-flash/demo", None, stage="first")
    return c.server_info().max_tokens + len(r.request_id) + len(fusedlayer.import_checkpoint("d").set_names)


async def status(c: fusedlayer.aio.AsyncClient) -> str:
    return await c.health()
PY
/usr/bin/python3 -m mypy --python-executable "$VENV/bin/python" --strict --no-incremental typed_use.py \
  || { echo "test-python: mypy --strict rejects a typed use of the package" >&2; exit 1; }
rc=0
# Tests marked cuda_host (CUDA tensors through CUDA shared memory) need a GPU, torch.cuda and a CUDA
# server: CI deselects them (they are not counted as passed there); the GPU host runs them with
# FUSEDLAYER_CUDA_HOST=1 and FUSEDLAYER_CUDA_SERVER=<a fusedlayer_server built with the GPU backend>.
MARKS="not cuda_host"
[ "${FUSEDLAYER_CUDA_HOST:-0}" = 1 ] && MARKS=""
FUSEDLAYER_SERVER="$SERVER" FUSEDLAYER_FUSEDCTL="$BUILD/client/fusedctl" "$VENV/bin/python" -m pytest -q -p no:cacheprovider --strict-markers -m "$MARKS" \
  "$ROOT/client/python/tests" || rc=$?
if [ "$rc" -ne 0 ]; then
  [ "$rc" -eq 5 ] && echo "test-python: pytest collected no tests" >&2
  echo "test-python: pytest failed (exit $rc)" >&2
  exit 1
fi

"$VENV/bin/python" "$ROOT/examples/whole_model.py" --server="$SERVER"
"$VENV/bin/python" "$ROOT/examples/whole_model.py" --server="$SERVER" --via_manifest --layers=2 --hidden=96
"$VENV/bin/python" "$ROOT/examples/whole_model.py" --server="$SERVER" --via_checkpoint --layers=2 --hidden=128
