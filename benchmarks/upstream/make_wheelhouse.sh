#!/usr/bin/env bash
# Build the offline wheelhouse for running upstream cosmos-framework's trainer on a GPU machine
# without network access (see README.md beside this script).
#
#   bash benchmarks/upstream/make_wheelhouse.sh DEST [--python-version 3.12] [--requirements FILE]
#        [--limit-mib 49]
#
# Downloads exactly the pins of requirements-gpu.txt (beside this script), one wheel each, with
# --no-deps, as manylinux x86_64 wheels for the given CPython version (default 3.12, the GPU
# machine's). Pins marked `# sdist` have no wheel on PyPI and are built here with `pip wheel
# --no-deps` (pure Python, so the wheel fits any version); pins marked `# strip=DIR` lose DIR
# (and its RECORD lines) to save space. DEST ends up with these wheels and nothing else: older
# wheels there are removed. Prints each wheel's size and the total, and exits 1 (leaving DEST as it
# was) when the total is over --limit-mib (default 49 MiB, env WHEELHOUSE_LIMIT_MIB), or when a pin got
# no wheel or two. At the pins of requirements-gpu.txt the cp312 set is 48.1 MiB: with a staged upstream
# (about 9 MiB) and this repo (about 1 MiB) it stays under the 64 MiB that can travel to the GPU machine.
#
# Environment: PYTHON (default python3) runs pip; it needs network access to the package index.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
dest=""
pyver="3.12"
req="$here/requirements-gpu.txt"
limit="${WHEELHOUSE_LIMIT_MIB:-49}"

usage() { sed -n '5,6p' "${BASH_SOURCE[0]}" | sed 's/^# *//' >&2; exit 2; }
while (( $# )); do
  case "$1" in
    --python-version) pyver="${2:?--python-version needs a value}"; shift 2 ;;
    --python-version=*) pyver="${1#*=}"; shift ;;
    --requirements) req="${2:?--requirements needs a file}"; shift 2 ;;
    --requirements=*) req="${1#*=}"; shift ;;
    --limit-mib) limit="${2:?--limit-mib needs a number}"; shift 2 ;;
    --limit-mib=*) limit="${1#*=}"; shift ;;
    -h|--help) usage ;;
    -*) echo "error: unknown option $1" >&2; usage ;;
    *) [[ -z "$dest" ]] || { echo "error: one DEST only" >&2; usage; }; dest="$1"; shift ;;
  esac
done
[[ -n "$dest" ]] || usage
[[ "$pyver" =~ ^3\.[0-9]+$ ]] || { echo "error: --python-version must look like 3.12, not '$pyver'" >&2; exit 2; }
[[ -f "$req" ]] || { echo "error: no requirements file $req" >&2; exit 2; }

binary=() sdist=() strips=()
while IFS= read -r line || [[ -n "$line" ]]; do
  spec="${line%%#*}"; spec="${spec//[[:space:]]/}"
  [[ -z "$spec" ]] && continue
  [[ "$spec" == *==* ]] || { echo "error: $req: '$spec' is not pinned with ==" >&2; exit 2; }
  comment=""; [[ "$line" == *"#"* ]] && comment="${line#*#}"
  if [[ "$comment" =~ (^|[[:space:]])sdist([[:space:]]|$) ]]; then sdist+=("$spec"); else binary+=("$spec"); fi
  if [[ "$comment" =~ strip=([^[:space:]]+) ]]; then strips+=("${spec%%==*}=${BASH_REMATCH[1]}"); fi
done < "$req"

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
abi="cp${pyver/./}"
echo "downloading ${#binary[@]} wheels for CPython $pyver (manylinux x86_64) ..." >&2
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$stage" \
  --python-version "$pyver" --implementation cp --abi "$abi" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  "${binary[@]}"
if (( ${#sdist[@]} )); then
  echo "building ${#sdist[@]} wheels from sdists: ${sdist[*]} ..." >&2
  "$PYTHON" -m pip wheel --quiet --no-deps --no-binary=:all: --wheel-dir "$stage" "${sdist[@]}"
fi

# Strip, check (one wheel per pin, the pinned version, nothing else), replace DEST, report.
mkdir -p "$dest"
"$PYTHON" - "$stage" "$dest" "$limit" "${#binary[@]}" "${binary[@]}" ${sdist[@]+"${sdist[@]}"} -- "${strips[@]+"${strips[@]}"}" <<'PY'
import os, re, shutil, sys, zipfile

stage, dest, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
rest = sys.argv[5:]
sep = rest.index("--")
pins, strips = rest[:sep], rest[sep + 1:]

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

pinned = {norm(p.split("==")[0]): p.split("==")[1] for p in pins}
wheels = {}
for fn in sorted(os.listdir(stage)):
    if not fn.endswith(".whl"):
        sys.exit(f"error: {fn} is not a wheel")
    name, version = fn.split("-")[:2]
    key = norm(name)
    if key in wheels:
        sys.exit(f"error: two wheels for {key}: {wheels[key]} and {fn}")
    if key not in pinned:
        sys.exit(f"error: {fn} is not in the pin list")
    if version != pinned[key]:
        sys.exit(f"error: {fn} is not the pinned version {pinned[key]}")
    wheels[key] = fn
missing = sorted(set(pinned) - set(wheels))
if missing:
    sys.exit(f"error: no wheel for {', '.join(missing)}")

for rule in strips:
    name, prefix = rule.split("=", 1)
    prefix = prefix.rstrip("/") + "/"
    src = os.path.join(stage, wheels[norm(name)])
    tmp = src + ".tmp"
    dropped = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename.startswith(prefix):
                dropped += info.file_size
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(l for l in lines if not l.startswith(prefix)).encode()
            zout.writestr(info, data)
    os.replace(tmp, src)
    print(f"stripped {prefix} from {wheels[norm(name)]} ({dropped / 2**20:.1f} MiB uncompressed)", file=sys.stderr)

sizes = {k: os.path.getsize(os.path.join(stage, fn)) for k, fn in wheels.items()}
total = sum(sizes.values())
for key in sorted(wheels, key=lambda k: -sizes[k]):
    print(f"{sizes[key] / 2**20:8.2f} MiB  {wheels[key]}")
if total > limit * 2**20:
    sys.exit(f"error: these wheels are {total / 2**20:.2f} MiB, over the {limit:g} MiB limit: {dest} left as it was")
for fn in os.listdir(dest):
    if fn.endswith(".whl"):
        os.remove(os.path.join(dest, fn))
for fn in wheels.values():
    shutil.move(os.path.join(stage, fn), os.path.join(dest, fn))
print(f"{total / 2**20:8.2f} MiB  total, {len(wheels)} wheels in {dest} (limit {limit:g} MiB)")
PY
