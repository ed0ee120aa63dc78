#!/usr/bin/env bash
# Regenerates the fuzz seed corpus in tests/fuzz/corpus/<target>/ (committed; deterministic, so
# rerunning it changes nothing unless the generator or the fixture changed). Reproducers of fixed
# findings (crash-<what>, tests/fuzz/README.md) are not generated and stay.
#
#   tests/fuzz/make_corpus.sh            (builds fuzz_make_corpus in build-fuzz/ first)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${FUZZ_BUILD_DIR:-$ROOT/build-fuzz}"
"$ROOT/scripts/fuzz.sh" --configure-only
cmake --build "$BUILD" -j"${JOBS:-$(nproc)}" --target fuzz_make_corpus
OUT="$ROOT/tests/fuzz/corpus"
# The generated seeds are replaced; the reproducers of fixed findings (crash-*) are kept.
for t in fuzz_safetensors fuzz_manifest fuzz_request_validation fuzz_weight_set_header fuzz_auth_files fuzz_wire_reader; do
  mkdir -p "${OUT:?}/$t"
  find "$OUT/$t" -maxdepth 1 -type f ! -name 'crash-*' -delete
done
ASAN_OPTIONS=detect_leaks=1 "$BUILD/tests/fuzz/fuzz_make_corpus" "$OUT"
du -sh "$OUT"/*
