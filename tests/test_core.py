"""The shared core: checkpoint manager, run lock, atomic writes, typed config."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from patches.core import config as cc
from patches.core.checkpoint import CheckpointManager
from patches.core.io import atomic_write
from patches.core.lock import RunLocked, hold_run_lock
from patches.core.trainer import Recipe, StepResult
from patches.core.trainer import run as run_trainer


def test_checkpoint_names_marker_and_latest(tmp_path):
    m = CheckpointManager(tmp_path)
    assert m.latest() is None and m.load_latest() is None
    m.save(2, {"x": torch.tensor(2)})
    p = m.save(10, {"x": torch.tensor(10)})
    assert p.name == "iter_000000010.pt"
    assert (m.dir / "latest_checkpoint.txt").read_text().strip() == p.name
    path, state = m.load_latest()
    assert path == p and int(state["x"]) == 10


def test_damaged_latest_falls_back_to_the_newest_good_one(tmp_path):
    m = CheckpointManager(tmp_path)
    m.save(1, {"x": torch.tensor(1)})
    p2 = m.save(2, {"x": torch.tensor(2)})
    p2.write_bytes(p2.read_bytes()[:40])  # truncated by a full disk, say
    with pytest.warns(UserWarning, match="iter_000000002.pt is damaged"):
        path, state = m.load_latest()
    assert path.name == "iter_000000001.pt" and int(state["x"]) == 1


def test_killed_save_leaves_no_file_under_a_real_name_and_stale_temps_are_cleaned(tmp_path):
    m = CheckpointManager(tmp_path)

    def dies(path):
        path.write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(m.path(3), dies)
    assert m.all() == [] and list(m.dir.iterdir()) == []
    (m.dir / ".iter_000000004.pt.tmp-abc").write_bytes(b"x")  # what a SIGKILL mid-save leaves
    assert [p.name for p in m.clean_stale()] == [".iter_000000004.pt.tmp-abc"]
    assert not CheckpointManager(tmp_path, write=False).save(5, {})  # ranks > 0 never write


def test_second_run_into_the_same_folder_is_refused_and_a_stale_lock_taken_over(tmp_path, capsys):
    with hold_run_lock(tmp_path) as lock:
        with pytest.raises(RunLocked, match=f"in use by process {os.getpid()}"):
            with hold_run_lock(tmp_path):
                pass
    assert not lock.exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import json
    import socket

    lock.write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    with hold_run_lock(tmp_path):
        pass
    assert "stale lock" in capsys.readouterr().out


@dataclasses.dataclass
class _Inner:
    rate: float = 0.1
    """EMA rate."""


@dataclasses.dataclass
class _Outer:
    name: str = "x"
    """Job name."""
    steps: int = 3
    """Optimizer steps."""
    keys: list[str] = dataclasses.field(default_factory=lambda: ["a"])
    """Keys."""
    ema: _Inner = dataclasses.field(default_factory=_Inner)
    """The EMA table."""


def test_typed_config_is_strict_and_documented():
    cfg = cc.from_mapping(_Outer, {"steps": 5, "ema": {"rate": 1}})
    assert cfg.steps == 5 and cfg.ema.rate == 1.0 and isinstance(cfg.ema.rate, float) and cfg.keys == ["a"]
    with pytest.raises(cc.ConfigError, match=r"unknown key\(s\) \['stepz'\]"):
        cc.from_mapping(_Outer, {"stepz": 5})
    with pytest.raises(cc.ConfigError, match=r'\[ema\].rate = "fast" has the wrong type: expected float'):
        cc.from_mapping(_Outer, {"ema": {"rate": "fast"}})
    with pytest.raises(cc.ConfigError, match="wrong type"):
        cc.from_mapping(_Outer, {"steps": True})  # a bool is not an int
    assert cc.field_docs(_Outer)["steps"] == "Optimizer steps."
    assert set(cc.field_docs(_Outer)) == {f.name for f in dataclasses.fields(_Outer)}


def test_atomic_writes_get_the_mode_a_plain_open_would(tmp_path):
    from patches.core.io import atomic_write_text

    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    made = atomic_write_text(tmp_path / "atomic.txt", "x")
    assert made.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777


def test_optional_fields_both_spellings_make_flags_and_load():
    import argparse

    @dataclasses.dataclass
    class Flags:
        port: int | None = None
        """Port."""
        batch: "int | None" = 4
        """Batch."""
        names: list[str] | None = None
        """Names."""
        deterministic: bool = False
        """Deterministic mode."""

    ap = argparse.ArgumentParser()
    cc.add_arguments(ap, Flags)
    got = cc.from_namespace(Flags, ap.parse_args(["--port", "7", "--names", "a", "b", "--deterministic"]))
    assert got == Flags(port=7, batch=4, names=["a", "b"], deterministic=True)
    assert cc.from_mapping(Flags, {"port": None, "batch": 3}).batch == 3
    with pytest.raises(cc.ConfigError, match="wrong type"):
        cc.from_mapping(Flags, {"port": "x"})


def test_checkpoints_hold_each_tensor_not_the_storage_it_views(tmp_path):
    """``torch.save`` writes a tensor's whole storage. At one rank under offload an H3 adapter's ``full_tensor()``
    views the exact pinned arena (the 33 B save wrote 68.4 GB of it on the H200 and filled the disk): the
    checkpoint writer saves each tensor with its own elements only. Planted: ``torch.save`` of the view itself."""
    from patches.core.io import atomic_torch_save, own_storage

    arena = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB standing for the arena
    view = arena[4096:4160]
    torch.save({"w": view}, tmp_path / "view.pt")
    assert (tmp_path / "view.pt").stat().st_size > 4 << 20  # the planted bug: the whole arena on disk
    atomic_torch_save({"w": view, "nested": [{"m": arena[:8].view(2, 4)}], "n": 3}, tmp_path / "own.pt")
    assert (tmp_path / "own.pt").stat().st_size < 64 << 10
    back = torch.load(tmp_path / "own.pt")
    assert torch.equal(back["w"], view) and torch.equal(back["nested"][0]["m"], arena[:8].view(2, 4))
    assert back["n"] == 3 and isinstance(back["nested"], list)
    own = torch.ones(8)
    assert own_storage(own) is own  # a tensor with storage of its own is not copied


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_checkpoint_views_cost_no_host_copy(dtype):
    """A contiguous CPU view is saved from the arena's own bytes: under full offload the 1.38 GB of fp32 H3 LoRA
    tensors would otherwise be copied once more at every save, on a host with 0.8 GB left under the 75 GB target.
    Non-contiguous views are copied (they cannot be one span of bytes)."""
    from patches.core.io import own_storage

    arena = (torch.arange(4096) % 7).to(dtype)
    view = arena[64:192].view(8, 16)
    alias = own_storage(view)
    assert alias.dtype == dtype and alias.shape == view.shape and torch.equal(alias, view)
    assert alias.data_ptr() == view.data_ptr()  # same bytes, no copy
    assert alias.storage_offset() == 0 and alias.untyped_storage().nbytes() == view.numel() * view.element_size()
    strided = arena[:256].view(16, 16)[:, :4]
    copy = own_storage(strided)
    assert torch.equal(copy, strided) and copy.data_ptr() != strided.data_ptr()
    assert copy.untyped_storage().nbytes() == strided.numel() * strided.element_size()


def test_checkpoint_writer_saves_sparse_and_nested_tensors(tmp_path):
    """Sparse (COO, CSR) and nested tensors have no one storage (``storage_offset()`` raises on them): the
    checkpoint writer leaves them to ``torch.save``, which writes their parts, as for a plain ``torch.save``.
    Planted: the storage check run on them (``NotImplementedError: Cannot access storage of SparseTensorImpl``)."""
    from patches.core.io import atomic_torch_save

    torch.manual_seed(0)
    state = {"coo": torch.randn(6, 6).to_sparse(), "csr": torch.randn(6, 6).to_sparse_csr(),
             "nested": torch.nested.nested_tensor([torch.randn(3), torch.randn(4)]), "view": torch.arange(64.0)[8:16]}
    atomic_torch_save(state, tmp_path / "s.pt")
    back = torch.load(tmp_path / "s.pt", weights_only=False)
    assert torch.equal(back["coo"].to_dense(), state["coo"].to_dense()) and back["coo"].is_sparse
    assert torch.equal(back["csr"].to_dense(), state["csr"].to_dense()) and back["csr"].layout == torch.sparse_csr
    assert all(torch.equal(a, b) for a, b in zip(back["nested"].unbind(), state["nested"].unbind()))
    assert torch.equal(back["view"], state["view"]) and back["view"].untyped_storage().nbytes() == 32


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise / statm: Linux")
def test_release_file_pages_drops_mapped_pages_only(tmp_path):
    """A tensor read from ``torch.load(mmap=True)`` gives its pages back (RSS falls by its size, its values read
    again from the file); an anonymous tensor is left alone (``MADV_DONTNEED`` would zero it)."""
    from patches.core.io import release_file_pages

    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    torch.save({"a": torch.randn(1 << 24)}, tmp_path / "x.pt")  # 64 MiB
    a = torch.load(tmp_path / "x.pt", mmap=True)["a"]
    total = float(a.sum())  # pages in
    before = rss()
    assert release_file_pages([a]) >= (64 << 20) - 8192
    assert before - rss() > 48 << 20 and float(a.sum()) == total
    anon = torch.randn(1 << 22)
    kept = anon.clone()
    assert release_file_pages({"b": anon}) == 0 and torch.equal(anon, kept)


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="madvise / pagemap: Linux")
def test_release_file_pages_keeps_pages_written_after_the_load(tmp_path):
    """``torch.load(mmap=True)`` maps the file privately: a write after the load makes the page the process's own
    copy (copy-on-write), and ``MADV_DONTNEED`` on it would drop the write and read the file's old values back.
    Such pages are kept; the unwritten pages of the same tensor are still dropped. Planted: every whole page of
    the tensor dropped (the values revert to the file's zeros)."""
    from patches.core.io import release_file_pages

    torch.save({"a": torch.zeros(1 << 20)}, tmp_path / "x.pt")  # 4 MiB of zeros
    a = torch.load(tmp_path / "x.pt", mmap=True)["a"]
    float(a.sum())  # every page read in from the file
    a[: 1 << 18].add_(5)  # the first quarter written after the load
    released = release_file_pages([a])
    assert float(a[: 1 << 18].min()) == 5.0 and float(a.sum()) == 5.0 * (1 << 18)
    assert (2 << 20) < released <= (3 << 20) + 8192  # the other three quarters went back


# ------------------------------------------------------------------------------- checkpoint order and retention
def test_checkpoints_are_ordered_by_step_not_by_file_time(tmp_path):
    """``all()`` is oldest *step* first and ``latest()`` the highest step, whatever the files' modification times
    (a copied or restored folder has arbitrary ones). Expectation by hand: steps 10 and 2 saved in that order, the
    step-10 file then made the older one on disk: ``all()`` still lists 2 before 10 and ``latest()`` is step 10."""
    m = CheckpointManager(tmp_path)
    p10 = m.save(10, {"x": torch.tensor(10)})
    p2 = m.save(2, {"x": torch.tensor(2)})
    os.utime(p10, (1_000_000, 1_000_000))
    os.utime(p2, (2_000_000, 2_000_000))
    assert m.all() == [(2, p2), (10, p10)]
    assert m.latest() == p10
    path, state = m.load_latest()
    assert path == p10 and int(state["x"]) == 10


def test_marker_is_written_only_after_the_file_is_complete(tmp_path, monkeypatch):
    """A save whose write fails (a full disk) leaves the marker naming the previous, complete checkpoint and no
    file under the new step's name: the marker must never name a file that is not complete. Expected by hand:
    after step 1 saved and step 2 failing, ``latest_checkpoint.txt`` reads ``iter_000000001.pt``."""
    m = CheckpointManager(tmp_path)
    m.save(1, {"x": torch.tensor(1)})

    def disk_full(obj, path, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        m.save(2, {"x": torch.tensor(2)})
    assert (m.dir / "latest_checkpoint.txt").read_text() == "iter_000000001.pt\n"
    assert not m.path(2).exists()
    assert sorted(p.name for p in m.dir.iterdir()) == ["iter_000000001.pt", "latest_checkpoint.txt"]


@pytest.mark.parametrize("keep, saves, left", [
    (2, [1, 2, 3, 4], [3, 4]),
    (1, [1, 2, 3], [3]),
    (3, [1, 2, 3, 4, 5], [3, 4, 5]),
    (0, [1, 2, 3, 4], [1, 2, 3, 4]),  # 0 keeps every checkpoint
    (2, [5, 6, 3], [3, 6]),  # a save below the newest step (a re-run from an older one): the new file stays
], ids=["keep2", "keep1", "keep3", "keep0-all", "new-file-below-newest"])
def test_retention_keeps_exactly_n_and_never_the_just_written_file(tmp_path, keep, saves, left):
    """``keep = N`` leaves exactly N checkpoints after each save: the one just written and the N - 1 highest-step
    others; ``keep = 0`` leaves all. The expected steps are written out by hand per case."""
    m = CheckpointManager(tmp_path, keep=keep)
    for s in saves:
        p = m.save(s, {"x": torch.tensor(s)})
        assert p.is_file()  # the file just written is never deleted
    assert [s for s, _ in m.all()] == left
    assert (m.dir / "latest_checkpoint.txt").read_text() == f"iter_{saves[-1]:09d}.pt\n"


def test_clean_stale_removes_only_hidden_temporaries(tmp_path):
    """``clean_stale`` removes what a killed atomic write leaves (``.<name>.tmp-<random>``: hidden AND marked), and
    nothing else: not a hidden file of the user's, not a visible name that merely contains ``.tmp-``, not a
    checkpoint. Expected set written by hand."""
    m = CheckpointManager(tmp_path)
    m.save(1, {"x": torch.tensor(1)})
    for name in (".iter_000000002.pt.tmp-abc", ".notes", "iter_000000003.pt.tmp-xyz", ".latest_checkpoint.txt.tmp-q"):
        (m.dir / name).write_bytes(b"x")
    assert sorted(p.name for p in m.clean_stale()) == [".iter_000000002.pt.tmp-abc", ".latest_checkpoint.txt.tmp-q"]
    assert sorted(p.name for p in m.dir.iterdir()) == [".notes", "iter_000000001.pt", "iter_000000003.pt.tmp-xyz",
                                                        "latest_checkpoint.txt"]


def test_atomic_write_uses_a_hidden_marked_temporary_in_the_same_folder(tmp_path):
    """The temporary an atomic write goes through is ``.<name>.tmp-<random>`` in the destination's folder (the
    documented pattern, which ``clean_stale`` finds after a SIGKILL): hidden, so no reader globbing ``iter_*.pt``
    sees a half file. Checked on the path the writer is handed."""
    seen = []

    def write(tmp):
        seen.append(tmp)
        tmp.write_bytes(b"data")

    atomic_write(tmp_path / "iter_000000007.pt", write)
    (tmp,) = seen
    assert tmp.parent == tmp_path and tmp.name.startswith(".iter_000000007.pt.tmp-") and len(tmp.name) > 23
    assert (tmp_path / "iter_000000007.pt").read_bytes() == b"data" and not tmp.exists()


# ------------------------------------------------------------------------------------------- the trainer skeleton
class _CountingRecipe(Recipe):
    """A minimal recipe: each step records its index; the checkpoint holds the list of trained steps."""

    def __init__(self, run_dir: Path, max_steps: int):
        self.run_dir, self.max_steps, self.trained = Path(run_dir), max_steps, []
        self.checkpoints = CheckpointManager(run_dir)

    def build(self, stack):
        pass

    def state_dict(self):
        return {"trained": list(self.trained)}

    def load_state_dict(self, state):
        self.trained = list(state["trained"])
        return len(self.trained)

    def train_step(self, step):
        self.trained.append(step)
        return StepResult(loss=float(step), seconds=0.01)

    def summary(self, start, results, checkpoint):
        return {"start": start, "losses": [r.loss for r in results],
                "checkpoint": checkpoint.name if checkpoint else None}


def test_trainer_saves_at_the_end_resumes_cleans_and_stops_when_done(tmp_path, capsys):
    """The skeleton's steps against hand-written expectations: a fresh 3-step run trains steps 0..2 and writes
    ``iter_000000003.pt`` (the default ``save_due`` is "after the last step"); a resume to 5 steps removes a killed
    save's temporary (and says so), trains steps 3 and 4 only, and writes ``iter_000000005.pt``; a third run at 5
    steps trains nothing, says "nothing to do" and returns the summary already on disk."""
    first = run_trainer(_CountingRecipe(tmp_path, 3))
    assert first == {"start": 0, "losses": [0.0, 1.0, 2.0], "checkpoint": "iter_000000003.pt"}
    assert [s for s, _ in CheckpointManager(tmp_path).all()] == [3]
    stale = tmp_path / "checkpoints" / ".iter_000000004.pt.tmp-dead"
    stale.write_bytes(b"half")
    capsys.readouterr()
    second = run_trainer(_CountingRecipe(tmp_path, 5))
    err = capsys.readouterr().err
    assert second == {"start": 3, "losses": [3.0, 4.0], "checkpoint": "iter_000000005.pt"}
    assert not stale.exists() and "removed 1 temporary file(s)" in err and ".iter_000000004.pt.tmp-dead" in err
    done = _CountingRecipe(tmp_path, 5)
    third = run_trainer(done)
    out = capsys.readouterr().out
    assert "nothing to do" in out and done.trained == [0, 1, 2, 3, 4]  # loaded, nothing trained
    assert third == second == json.loads((tmp_path / "summary.json").read_text())


# ---------------------------------------------------------------------------------------------- the run lock
NO_SUCH_PID = (1 << 22) + 7
"""Above Linux's largest pid_max (2**22): no process can have it."""


def test_lock_of_another_host_is_never_taken_over(tmp_path):
    """A lock written on another host names a pid this host cannot check: it is refused (RunLocked naming the
    process and the host), never removed as stale, even when that pid does not exist here."""
    import socket

    lock = tmp_path / ".onecard.lock"
    dead = NO_SUCH_PID  # no process here has it
    host = socket.gethostname() + "-other"
    lock.write_text(json.dumps({"pid": dead, "host": host}))
    with pytest.raises(RunLocked, match=f"in use by process {dead} on {host}"):
        with hold_run_lock(tmp_path):
            pass
    assert json.loads(lock.read_text())["host"] == host  # left as it was


def test_lock_of_another_users_live_process_is_not_taken_over(tmp_path, monkeypatch):
    """``os.kill(pid, 0)`` on a live process of another user raises ``PermissionError`` (EPERM): that process
    exists, so its lock is refused, not taken over. Simulated with an ``os.kill`` that raises as the kernel does
    for such a pid (only for that pid)."""
    import socket

    other = NO_SUCH_PID
    real_kill = os.kill

    def kill(pid, sig):
        if pid == other:
            raise PermissionError(1, "Operation not permitted")
        return real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", kill)
    lock = tmp_path / ".onecard.lock"
    lock.write_text(json.dumps({"pid": other, "host": socket.gethostname()}))
    with pytest.raises(RunLocked, match=f"in use by process {other}"):
        with hold_run_lock(tmp_path):
            pass
    assert lock.exists()


# ------------------------------------------------------------------------------------------- the host arena
def test_host_arena_aligns_each_view_to_64_bytes_and_no_more():
    """Each view starts at the next multiple of 64 bytes, and ``nbytes`` is the end of the last view. By hand:
    float32 x3 (12 B) at 0, uint8 x5 at 64, float64 x1 at 128 -> nbytes 136; an already aligned end (16 float32 =
    64 B) puts the next view at 64, not 128."""
    from patches.core.host_arena import HostArena

    a = HostArena([((3,), torch.float32), ((5,), torch.uint8), ((1,), torch.float64)], pin=False)
    base = a.tensors[0].data_ptr()
    assert [t.data_ptr() - base for t in a.tensors] == [0, 64, 128]
    assert a.nbytes == 136 and a.pinned_bytes == 0
    b = HostArena([((4, 4), torch.float32), ((2,), torch.float32)], pin=False)
    assert b.tensors[1].data_ptr() - b.tensors[0].data_ptr() == 64 and b.nbytes == 72
    assert HostArena([], pin=False).nbytes == 0
    assert [tuple(t.shape) for t in a.tensors] == [(3,), (5,), (1,)]
    assert [t.dtype for t in a.tensors] == [torch.float32, torch.uint8, torch.float64]


# ------------------------------------------------------------------------------------------------ the flags
def test_resident_blocks_parser_accepts_ints_and_ascii_digits_only():
    """``parse_resident_blocks``: an int >= 0 is a count (0 included: stream every block); a bool is not a count
    (``True`` is refused, not read as 1); text must be ASCII digits (Arabic-Indic ``\u0663`` reads as 3 with
    ``int()`` but is refused)."""
    from patches.core.flags import FlagError, parse_resident_blocks

    src = "--fsdp-resident-blocks"
    assert parse_resident_blocks(0, src) == 0 and parse_resident_blocks(3, src) == 3
    assert parse_resident_blocks("0", src) == 0
    for bad in (True, False, "\u0663", "\u00b3", "-1", -1):
        with pytest.raises(FlagError, match="fsdp-resident-blocks"):
            parse_resident_blocks(bad, src)
    # a count past 9 digits is one error line (int() of a 5,000-digit string would raise a ValueError instead)
    assert parse_resident_blocks("000999999999", src) == 999999999
    for bad in ("1234567890", "9" * 5000):
        with pytest.raises(FlagError, match=r"^--fsdp-resident-blocks '\d{1,40}(\.\.\.)?': use auto"):
            parse_resident_blocks(bad, src)


def test_env_numbers_refuse_infinity_and_a_budget_beside_a_count():
    """``env_number`` / ``MILES_GPU_BUDGET_GIB`` take a finite number above the bound: ``inf`` is refused like
    ``nan``; and the budget only goes with ``MILES_RESIDENT_BLOCKS=auto`` (with a count, or no residency flag, it
    is refused)."""
    from patches.core.flags import FlagError, env_number, miles_gpu_budget_gib, read_miles

    for raw in ("inf", "-inf", "nan", "0", "abc"):
        with pytest.raises(FlagError, match="MILES_GPU_BUDGET_GIB"):
            miles_gpu_budget_gib({"MILES_GPU_BUDGET_GIB": raw})
    assert miles_gpu_budget_gib({"MILES_GPU_BUDGET_GIB": "40"}) == 40.0
    assert env_number("X", 0.01, "fix", {"X": "0.01"}, at_least=True) == 0.01
    with pytest.raises(FlagError, match="X='inf'"):
        env_number("X", 0.01, "fix", {"X": "inf"}, at_least=True)
    on = {"MILES_ONECARD_FSDP": "1", "MILES_GPU_BUDGET_GIB": "40"}
    for blocks in ("3", "0", ""):
        with pytest.raises(FlagError, match="MILES_RESIDENT_BLOCKS=auto"):
            read_miles(dict(on, MILES_RESIDENT_BLOCKS=blocks))
    assert read_miles(dict(on, MILES_RESIDENT_BLOCKS="auto"))["MILES_RESIDENT_BLOCKS"] == "auto"
