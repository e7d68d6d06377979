#!/usr/bin/env bash
# Copy what upstream cosmos-framework's trainer needs from a checkout into DEST (an ignored folder of
# this repo, e.g. .carry/cf), small enough to travel to an offline GPU machine next to the wheelhouse.
#
#   bash benchmarks/upstream/stage_upstream.sh SRC DEST
#
# Copies SRC/cosmos_framework (without its *_test.py / test_*.py files and caches), the root
# sitecustomize.py (the launcher puts the checkout first on PYTHONPATH, as upstream's launchers do),
# pyproject.toml and the licence files. DEST is emptied first. Prints DEST's size. Use DEST as
# COSMOS_FRAMEWORK_ROOT. Nothing is changed in SRC.
set -euo pipefail

[[ $# -eq 2 ]] || { sed -n '5p' "${BASH_SOURCE[0]}" | sed 's/^# *//' >&2; exit 2; }
src="$1" dest="$2"
[[ -d "$src/cosmos_framework" ]] || { echo "error: $src is not a cosmos-framework checkout (no cosmos_framework/ in it)" >&2; exit 2; }
src="$(cd "$src" && pwd)"
mkdir -p "$dest"
dest="$(cd "$dest" && pwd)"
[[ "$dest" != "$src" ]] || { echo "error: DEST is SRC" >&2; exit 2; }

find "$dest" -mindepth 1 -delete
cp -a "$src/cosmos_framework" "$dest/"
for f in sitecustomize.py pyproject.toml LICENSE NOTICE; do
  if [[ -f "$src/$f" ]]; then cp -a "$src/$f" "$dest/"; fi
done
find "$dest/cosmos_framework" \( -name '*_test.py' -o -name 'test_*.py' -o -name 'conftest.py' \) -type f -delete
find "$dest/cosmos_framework" \( -name '__pycache__' -o -name '.pytest_cache' \) -type d -prune -exec rm -rf {} +
rev="$(git -C "$src" rev-parse --short HEAD 2>/dev/null || true)"
echo "${rev:-unknown (not a git checkout)}" > "$dest/.onecard-staged-from"
echo "staged $src (commit ${rev:-unknown}) -> $dest: $(du -sh "$dest" | cut -f1), $(find "$dest" -type f | wc -l) files" >&2
