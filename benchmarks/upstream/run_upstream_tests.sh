#!/usr/bin/env bash
# Run upstream cosmos-framework's own tests for the modules onecard's patch table touches, stock and
# patched, and compare the outcome of every test.
#
#   COSMOS_FRAMEWORK_ROOT=CHECKOUT bash benchmarks/upstream/run_upstream_tests.sh OUT_DIR [TEST_FILE...]
#
# CHECKOUT  a full cosmos-framework checkout (ed8287f or 5eee9ed) with its tests, .pytest.toml and
#           conftest.py (stage_upstream.sh drops the tests: do not use its copy here).
# TEST_FILE paths relative to CHECKOUT; default: the list below, those that exist at that commit.
# Stock is `PYTHON -m pytest` with every onecard flag unset; patched is `PYTHON -m patches.run pytest`
# with every patch-table flag on (COSMOS_EMA_CPU_SUBSET, COSMOS_VAE_CPU_OFFLOAD,
# COSMOS_OPTIM_STATE_OFFLOAD, COSMOS_FROZEN_BF16, COSMOS_LATENT_CACHE, COSMOS_DETACH_TEXT_STREAM =1,
# COSMOS_ATTN_BACKEND=torch; the
# latent cache in a fresh folder under OUT_DIR).
# Writes OUT_DIR/{stock,patched}.{xml,log}, OUT_DIR/compare.json and OUT_DIR/compare.md.
# Exit 0 iff every test id has the same outcome (passed/failed/error/skipped) in both runs.
#
# Environment: PYTHON (upstream's interpreter, default python3; it needs upstream's deps and its dev
# pytest plugins pytest-env, pytest-custom_exit_code, pytest-xdist), ONECARD_ROOT (default: the repo
# holding this script), PYTEST_ARGS (extra pytest arguments, word-split), EXTRA_PYTHONPATH (put first on
# PYTHONPATH in both runs, e.g. a wheel target folder on the GPU machine). Tests that need CUDA are
# skipped by upstream itself where there is none and run where there is: nothing here is CPU-specific.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ONECARD_ROOT="${ONECARD_ROOT:-$(cd "$here/../.." && pwd)}"
PYTHON="${PYTHON:-python3}"
[[ $# -ge 1 ]] || { sed -n '5p' "${BASH_SOURCE[0]}" | sed 's/^# *//' >&2; exit 2; }
root="${COSMOS_FRAMEWORK_ROOT:-}"
[[ -n "$root" && -d "$root/cosmos_framework" && -f "$root/.pytest.toml" ]] || {
  echo "error: set COSMOS_FRAMEWORK_ROOT to a full cosmos-framework checkout (got '$root')" >&2; exit 2; }
root="$(cd "$root" && pwd)"
mkdir -p "$1"; out="$(cd "$1" && pwd)"; shift

if [[ $# -gt 0 ]]; then files=("$@"); else
  files=()
  for f in model/generator/omni_mot_model_test.py checkpoint/dcp_distill_test.py \
    model/generator/mot/attention_test.py model/generator/mot/flex_attention_test.py \
    model/generator/mot/unified_mot_test.py model/generator/mot/context_parallel_test.py \
    model/attention/utils/backend_filter_test.py model/attention/utils/determinism_test.py \
    model/attention/utils/version_test.py model/attention/utils/safe_ops/safe_lru_cache_test.py \
    model/generator/distillation/optimizer_test.py data/generator/local_datasets/sft_dataset_caption_test.py; do
    if [[ -f "$root/cosmos_framework/$f" ]]; then files+=("cosmos_framework/$f"); fi
  done
fi
flags=(COSMOS_EMA_CPU_SUBSET COSMOS_VAE_CPU_OFFLOAD COSMOS_OPTIM_STATE_OFFLOAD COSMOS_ATTN_BACKEND
       COSMOS_LATENT_CACHE COSMOS_FROZEN_BF16 COSMOS_DETACH_TEXT_STREAM)
unset_flags=(); for f in "${flags[@]}"; do unset_flags+=(-u "$f"); done
read -r -a extra <<< "${PYTEST_ARGS:-}"
pp="${EXTRA_PYTHONPATH:+$EXTRA_PYTHONPATH:}$root"

run() {  # run MODE: pytest, stock or patched; its exit status (0/1/5 are normal outcomes) is kept in the log
  local mode="$1" rc=0; shift
  (cd "$root" && env "${unset_flags[@]}" "$@" "$PYTHON" -m "${launcher[@]}" pytest -p no:cacheprovider \
     -c .pytest.toml -rA --continue-on-collection-errors --junitxml="$out/$mode.xml" "${extra[@]}" "${files[@]}") > "$out/$mode.log" 2>&1 || rc=$?
  echo "pytest exit status: $rc" >> "$out/$mode.log"; echo "$mode: pytest exit status $rc" >&2
}
launcher=(); run stock PYTHONPATH="$pp"
rm -rf "$out/latents"
launcher=(patches.run); run patched PYTHONPATH="$ONECARD_ROOT:$pp" COSMOS_FRAMEWORK_ROOT="$root" \
  COSMOS_EMA_CPU_SUBSET=1 COSMOS_VAE_CPU_OFFLOAD=1 COSMOS_OPTIM_STATE_OFFLOAD=1 COSMOS_FROZEN_BF16=1 \
  COSMOS_LATENT_CACHE=1 ONECARD_LATENT_CACHE="$out/latents" COSMOS_ATTN_BACKEND=torch COSMOS_DETACH_TEXT_STREAM=1

"$PYTHON" - "$out" "$root" "${files[@]}" <<'EOF'
import json, re, subprocess, sys, xml.etree.ElementTree as ET
from pathlib import Path
out, root, files = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
mods = sorted(((f[:-3].replace("/", "."), f) for f in files), key=lambda m: -len(m[0]))

def outcomes(mode):
    res = {}
    for tc in ET.parse(out / f"{mode}.xml").getroot().iter("testcase"):
        cls, name = tc.get("classname", ""), tc.get("name", "")
        kind = next((c.tag for c in tc if c.tag in ("failure", "error", "skipped")), "passed")
        kind = {"failure": "failed"}.get(kind, kind)
        msg = next((c.get("message", "") for c in tc if c.tag in ("failure", "error", "skipped")), "")
        file = next((f for m, f in mods if cls == m or cls.startswith(m + ".")), cls)
        res[f"{cls}::{name}"] = {"file": file, "outcome": kind, "message": msg[:300]}
    return res

log = {m: (out / f"{m}.log").read_text(errors="replace") for m in ("stock", "patched")}
s, p = outcomes("stock"), outcomes("patched")
ids = sorted(set(s) | set(p))
diff = [{"id": i, "stock": s.get(i, {}).get("outcome", "absent"), "patched": p.get(i, {}).get("outcome", "absent"),
         "patched_message": p.get(i, {}).get("message", "")} for i in ids
        if s.get(i, {}).get("outcome") != p.get(i, {}).get("outcome")]
def count(res, f):
    c = {"collected": 0, "passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for r in res.values():
        if r["file"] == f:
            c["collected"] += 1; c[r["outcome"]] += 1
    c["skip_reasons"] = sorted({r["message"] for r in res.values() if r["file"] == f and r["outcome"] == "skipped"})
    return c
rev = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
torch_v = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, torch.cuda.is_available())"],
                         capture_output=True, text=True).stdout.split()
patched_line = next((l for l in log["patched"].splitlines() if l.startswith("onecard[")), "")
per_file = {f: {"stock": count(s, f), "patched": count(p, f),
                "same": not [d for d in diff if (s.get(d["id"]) or p.get(d["id"]))["file"] == f]} for f in files}
summary = {"commit": rev or "unknown", "torch": torch_v[:1], "cuda_available": torch_v[1:] == ["True"],
           "patched_line": patched_line, "files": per_file, "differences": diff, "tests": len(ids),
           "deselected": {m: int((re.findall(r"(\d+) deselected", log[m]) or [0])[-1]) for m in log},
           "pytest_exit": {m: log[m].rsplit("pytest exit status: ", 1)[-1].strip() for m in log},
           "same": not diff and bool(ids)}
(out / "compare.json").write_text(json.dumps(summary, indent=1) + "\n")
fmt = lambda c: f"{c['collected']} / {c['passed']} / {c['failed'] + c['error']} / {c['skipped']}"
rows = [f"Commit `{summary['commit']}`, torch {' '.join(summary['torch'])}, CUDA {summary['cuda_available']}. "
        f"Cells: collected / passed / failed+error / skipped.", "",
        "| test file | stock | patched | same per test | skip reasons (stock) |", "|---|---|---|---|---|"]
for f, r in per_file.items():
    reasons = "; ".join(r["stock"]["skip_reasons"]).replace("|", "\\|") or "-"
    rows.append(f"| `{f.removeprefix('cosmos_framework/')}` | {fmt(r['stock'])} | {fmt(r['patched'])} | "
                f"{'yes' if r['same'] else '**no**'} | {reasons} |")
rows += ["", f"Patched run: `{patched_line}`", ""]
rows += [f"- differs: `{d['id']}` stock {d['stock']}, patched {d['patched']}: {d['patched_message']}" for d in diff]
(out / "compare.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
sys.exit(0 if summary["same"] else 1)
EOF
