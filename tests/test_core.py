"""The shared core: checkpoint manager, run lock, atomic writes, typed config."""

from __future__ import annotations

import dataclasses
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
    with pytest.raises(cc.ConfigError, match=r"\[ema\].rate = 'fast' has the wrong type"):
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
