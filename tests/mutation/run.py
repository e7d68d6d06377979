"""The mutation check: put each mutant of ``mutants.toml`` alone into a copy of the repository and run its tests.

``python tests/mutation/run.py [--cuda] [--min 0.95] [--only ID ...] [--jobs N] [--timeout S] [--no-baseline]
[--mutants FILE]``

For each mutant: the repository's files (``git ls-files``: tracked, plus untracked files git does not ignore)
are copied to a fresh temporary directory, the mutant's ``original`` snippet is replaced by its
``replacement`` inside its ``function`` of its ``file`` (a dotted name such as ``EMA.update`` or ``power_ema_beta``, the
innermost ``def``/``class`` holding the snippet, or ``<module>`` for module-level code; refused unless the snippet
occurs exactly once in that function's source, so an edit elsewhere in the file does not make the list stale), and
``python -m pytest -q -x -p no:cacheprovider <its tests>`` runs there with a timeout (``PYTHONPATH`` and the
working directory point at the copy, so subprocesses the tests start import the mutated code too). A failing
or timed-out run means the mutant was killed; a passing run means it survived. Before the mutants, the union of
their tests runs once on an unmutated copy (the baseline: a test that fails anyway would "kill" everything).

Prints one line per mutant and a summary line ``mutation: K/N killed (R %) ...``. CUDA-only mutants (``cuda =
true``) are listed and skipped unless ``--cuda``. Exit status: 0 when the kill rate is at least ``--min``; 1
below it; 2 when the list is stale (a snippet not found exactly once, a named test missing), the baseline fails,
or a mutant's run is an error (a pytest usage error such as an unknown parametrize id, or every test skipped,
as a CUDA test is without a GPU).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[2]
MUTANTS = Path(__file__).with_name("mutants.toml")
FIELDS = {"id", "kind", "file", "function", "original", "replacement", "tests", "cuda"}
REQUIRED = FIELDS - {"cuda"}


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    kind: str
    file: str
    function: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    cuda: bool = False


@dataclasses.dataclass
class Outcome:
    mutant: Mutant
    status: str  # "killed", "survived", "error"
    seconds: float
    detail: str = ""


class StaleList(Exception):
    """The mutant list does not match the repository (the message lists every problem)."""


def load_mutants(path: Path = MUTANTS) -> list[Mutant]:
    """The mutants of ``path``; :class:`StaleList` on a malformed entry or a duplicate id."""
    raw = tomllib.loads(path.read_text())
    entries = raw.get("mutant", [])
    problems, out, seen = [], [], set()
    for i, e in enumerate(entries):
        missing, unknown = REQUIRED - set(e), set(e) - FIELDS
        if missing or unknown:
            problems.append(f"mutant #{i + 1} ({e.get('id', '?')}): missing {sorted(missing)}, unknown {sorted(unknown)}")
            continue
        if e["id"] in seen:
            problems.append(f"mutant id {e['id']!r} is used twice")
        seen.add(e["id"])
        if not e["tests"] or e["original"] == e["replacement"]:
            problems.append(f"mutant {e['id']}: needs at least one test and a replacement that differs")
        out.append(Mutant(e["id"], e["kind"], e["file"], e["function"], e["original"], e["replacement"],
                          tuple(e["tests"]), bool(e.get("cuda", False))))
    if problems:
        raise StaleList("\n".join(problems))
    return out


def function_span(text: str, function: str) -> tuple[int, int] | None:
    """Character offsets ``(start, end)`` of ``function`` (a dotted ``def``/``class`` path, or ``<module>``) in the
    source ``text``; ``None`` when there is no such definition."""
    if function == "<module>":
        return 0, len(text)
    scope: list[ast.stmt] = ast.parse(text).body
    node = None
    for part in function.split("."):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return None
        scope = node.body
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return starts[first - 1], starts[node.end_lineno]


def innermost_function(text: str, offset: int) -> str:
    """The dotted name of the innermost ``def``/``class`` whose source holds character ``offset`` (``<module>`` if
    none): what a new mutant's ``function`` should say."""
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    best = "<module>"

    def walk(body: list[ast.stmt], prefix: str) -> None:
        nonlocal best
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if starts[n.lineno - 1] <= offset < starts[n.end_lineno]:
                    best = prefix + n.name
                    walk(n.body, best + ".")

    walk(ast.parse(text).body, "")
    return best


def locate(mutant: Mutant, root: Path) -> tuple[str, int, int]:
    """The file's text and the snippet's span inside the mutant's function.

    Raises:
        StaleList: the file or function is missing, or the snippet does not occur exactly once in the function.
    """
    path = root / mutant.file
    if not path.is_file():
        raise StaleList(f"mutant {mutant.id}: {mutant.file} does not exist")
    text = path.read_text()
    span = function_span(text, mutant.function)
    if span is None:
        raise StaleList(f"mutant {mutant.id}: {mutant.file} has no function {mutant.function}")
    body = text[span[0]:span[1]]
    n = body.count(mutant.original)
    if n != 1:
        raise StaleList(f"mutant {mutant.id}: its original snippet occurs {n} times in {mutant.function} of "
                        f"{mutant.file} (needs exactly 1): {mutant.original.strip().splitlines()[0][:80]!r}")
    start = span[0] + body.index(mutant.original)
    return text, start, start + len(mutant.original)


def apply(mutant: Mutant, root: Path) -> None:
    """Replace the mutant's snippet inside its function of ``root / mutant.file``; :class:`StaleList` unless it occurs
    exactly once there."""
    text, start, end = locate(mutant, root)
    (root / mutant.file).write_text(text[:start] + mutant.replacement + text[end:])


def node_exists(node: str, root: Path = REPO) -> bool:
    """Whether the pytest node id ``node`` names a test function (or class method) that exists, or a whole test file
    (``tests/test_x.py``: every test in it), read statically.

    Parametrize ids (``[...]``) are not checked here; pytest reports a wrong one as a usage error (exit 2 of
    :func:`main`).
    """
    file, _, rest = node.partition("::")
    path = root / file
    if not path.is_file():
        return False
    if not rest:
        return path.name.startswith("test_") and path.suffix == ".py"
    parts = re.sub(r"\[.*\]$", "", rest).split("::")
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for i, name in enumerate(parts):
        last = i == len(parts) - 1
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef) if last else (ast.ClassDef,)
        found = next((n for n in scope if isinstance(n, kinds) and n.name == name), None)
        if found is None:
            return False
        scope = found.body if isinstance(found, ast.ClassDef) else []
    return True


def problems(mutants: list[Mutant], root: Path = REPO) -> list[str]:
    """Everything stale in ``mutants`` against the repository at ``root`` (empty when the list is good)."""
    out = []
    for m in mutants:
        try:
            locate(m, root)
        except StaleList as e:
            out.append(str(e))
        out += [f"mutant {m.id}: test {t} does not exist" for t in m.tests if not node_exists(t, root)]
    return out


def repo_files(root: Path = REPO) -> list[str]:
    """Tracked files plus untracked files git does not ignore (what a fresh checkout with local changes holds)."""
    res = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                         capture_output=True, text=True, check=True)
    return [f for f in res.stdout.split("\0") if f and (root / f).is_file()]


def copy_repo(dest: Path, files: list[str], root: Path = REPO) -> None:
    for f in files:
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, target)


def run_pytest(root: Path, nodes: list[str], timeout: float, extra: list[str] = ()) -> tuple[int | None, str]:
    """``(exit status, output)`` of pytest on ``nodes`` in the copy at ``root``; status ``None`` on a timeout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *extra, *nodes]
    try:
        res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out
    return res.returncode, res.stdout + res.stderr


def _first_failure(output: str) -> str:
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    return m.group(1) if m else ""


def run_mutant(mutant: Mutant, files: list[str], timeout: float) -> Outcome:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"onecard-mutant-{mutant.id}-") as tmp:
        root = Path(tmp)
        copy_repo(root, files)
        apply(mutant, root)
        rc, out = run_pytest(root, list(mutant.tests), timeout)
    dt = time.perf_counter() - t0
    if rc is None:
        return Outcome(mutant, "killed", dt, f"timeout after {timeout:.0f} s")
    if rc == 0 and not re.search(r"\b\d+ passed", out):
        return Outcome(mutant, "error", dt, "its tests did not run (all skipped: a CUDA test without a GPU?)")
    if rc == 0:
        return Outcome(mutant, "survived", dt, "its tests pass")
    if rc == 1:
        return Outcome(mutant, "killed", dt, _first_failure(out))
    tail = " | ".join(out.strip().splitlines()[-3:])
    return Outcome(mutant, "error", dt, f"pytest exit {rc}: {tail[:300]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tests/mutation/run.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuda", action="store_true", help="also run the CUDA-only mutants (needs a GPU)")
    ap.add_argument("--min", type=float, default=0.95, help="minimum kill rate (default 0.95); exit 1 below it")
    ap.add_argument("--only", nargs="+", metavar="ID", help="run only these mutants")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at the same time (default 1)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mutant's test run (default 900)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the listed tests")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--mutants", type=Path, default=MUTANTS, help=f"the mutant list (default {MUTANTS.relative_to(REPO)})")
    args = ap.parse_args(argv)

    try:
        mutants = load_mutants(args.mutants)
        stale = problems(mutants)
        if stale:
            raise StaleList("\n".join(stale))
    except StaleList as e:
        print(f"error: {args.mutants} is stale:\n{e}", file=sys.stderr)
        return 2
    if args.only:
        unknown = set(args.only) - {m.id for m in mutants}
        if unknown:
            print(f"error: no mutant named {sorted(unknown)}", file=sys.stderr)
            return 2
        mutants = [m for m in mutants if m.id in set(args.only)]
    if args.list:
        for m in mutants:
            print(f"{m.id:45s} {m.file:36s} {m.kind}{'  (CUDA-only)' if m.cuda else ''}")
        return 0
    run = [m for m in mutants if args.cuda or not m.cuda]
    skipped = [m for m in mutants if m not in run]
    files = repo_files()

    if not args.no_baseline and run:
        nodes = sorted({t for m in run for t in m.tests})
        print(f"baseline: {len(nodes)} test node(s) on an unmutated copy ...", flush=True)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="onecard-mutant-baseline-") as tmp:
            copy_repo(Path(tmp), files)
            rc, out = run_pytest(Path(tmp), nodes, args.timeout * 2)
        if rc != 0:
            print(f"error: the baseline fails (exit {rc}); the listed tests must pass unmutated:\n{out[-3000:]}",
                  file=sys.stderr)
            return 2
        print(f"baseline: ok ({time.perf_counter() - t0:.0f} s)", flush=True)

    outcomes: list[Outcome] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(run_mutant, m, files, args.timeout) for m in run]
        for fut in futures:
            o = fut.result()
            outcomes.append(o)
            print(f"{o.status.upper():9s} {o.mutant.id:45s} {o.seconds:6.1f} s  {o.detail}", flush=True)
    for m in skipped:
        print(f"{'SKIPPED':9s} {m.id:45s}          CUDA-only ({m.kind}): run with --cuda on a GPU")

    killed = sum(o.status == "killed" for o in outcomes)
    errors = [o for o in outcomes if o.status == "error"]
    total = len(outcomes)
    rate = killed / total if total else 1.0
    where = "CPU + CUDA" if args.cuda else "CPU"
    print(f"mutation: {killed}/{total} killed ({100 * rate:.1f} %) on {where}; "
          f"{sum(o.status == 'survived' for o in outcomes)} survived, {len(errors)} error(s); "
          f"{len(skipped)} CUDA-only mutant(s) not run{' (--cuda runs them)' if skipped else ''}; min {100 * args.min:.0f} %")
    if errors:
        return 2
    return 0 if rate >= args.min else 1


if __name__ == "__main__":
    sys.exit(main())
