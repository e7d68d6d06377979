"""patches.core.streamsave: a torch.save file written one tensor at a time, deferred entries made as they are written.

The reference is ``torch.save`` of the same object with every :class:`Deferred` made beforehand. Planted (same file):
the CRC-32s left as the skeleton wrote them (``zipfile`` then reports the archive damaged); every deferred entry made
before the first write (more than one made tensor alive at once); a writer that makes a deferred entry with ``piece``
whole (more than one piece's bytes at once).
"""

from __future__ import annotations

import weakref
import zipfile

import pytest
import torch

from tests.equivalence.test_checkpoint_stream import flat as leaves  # (path, tensor) of every leaf

from patches.core import streamsave
from patches.core.io import atomic_torch_save
from patches.core.streamsave import Deferred, holds_deferred


class Maker:
    """Deferred entries whose ``make`` checks that no tensor an earlier ``make`` returned is still alive."""

    def __init__(self) -> None:
        self.alive: list[weakref.ref] = []
        self.most_alive = 0

    def __call__(self, value: torch.Tensor) -> Deferred:
        def make() -> torch.Tensor:
            self.most_alive = max(self.most_alive, 1 + sum(r() is not None for r in self.alive))
            t = value.clone()
            self.alive.append(weakref.ref(t))
            return t
        return Deferred(value.shape, value.dtype, make)


def sample(maker: Maker) -> tuple[dict, dict]:
    """(an object with deferred entries, what it is with them made)."""
    torch.manual_seed(0)
    a = torch.randn(100, 3)
    b = torch.randn(4, 5).to(torch.bfloat16)
    made = {"f": torch.randn(7, 2), "i": torch.arange(6), "nc": torch.randn(5, 6).T, "big": torch.randn(300, 50)}
    deferred = {k: maker(v) for k, v in made.items()}
    common = {"a": a, "view": a[10:20], "again": a, "b": b, "bT": b.T, "empty": torch.empty(0), "n": 5, "s": "x"}
    obj = {**common, "nested": [deferred["f"], (deferred["i"], deferred["nc"]), {"big": deferred["big"]}]}
    ref = {**common, "view": a[10:20].clone(), "nested": [made["f"], (made["i"], made["nc"]), {"big": made["big"]}]}
    return obj, ref




def same(a: dict, b: dict) -> bool:
    la, lb = dict(leaves(a)), dict(leaves(b))
    return la.keys() == lb.keys() and all(
        la[k].dtype == lb[k].dtype and la[k].shape == lb[k].shape and torch.equal(la[k], lb[k]) for k in la)


def test_the_file_loads_as_torch_save_of_the_made_object(tmp_path):
    maker = Maker()
    obj, ref = sample(maker)
    assert holds_deferred(obj) and not holds_deferred(ref)
    atomic_torch_save(obj, tmp_path / "s.pt")
    back = torch.load(tmp_path / "s.pt", weights_only=True)
    assert same(back, ref) and back["n"] == 5 and back["s"] == "x"
    assert back["again"].data_ptr() == back["a"].data_ptr()  # one storage, written once, loaded shared
    assert same(torch.load(tmp_path / "s.pt", weights_only=True, mmap=True), ref)
    assert maker.most_alive == 1


def test_the_file_is_a_valid_zip_archive(tmp_path):
    atomic_torch_save(sample(Maker())[0], tmp_path / "s.pt")
    with zipfile.ZipFile(tmp_path / "s.pt") as z:
        assert z.testzip() is None  # every record's CRC-32 matches its bytes


def test_planted_crc_left_as_the_skeleton_wrote_it_damages_the_archive(tmp_path, monkeypatch):
    monkeypatch.setattr(streamsave.zlib, "crc32", lambda data, value=0: 0)
    atomic_torch_save(sample(Maker())[0], tmp_path / "s.pt")
    with zipfile.ZipFile(tmp_path / "s.pt") as z:
        assert z.testzip() is not None


def test_planted_entries_made_before_the_write_are_all_alive_at_once(tmp_path, monkeypatch):
    real = streamsave.save

    def eager(obj, path):  # make every deferred entry, then write
        def made(o):
            if isinstance(o, Deferred):
                return o.make()
            if isinstance(o, dict):
                return {k: made(v) for k, v in o.items()}
            if isinstance(o, (list, tuple)):
                return type(o)(made(v) for v in o)
            return o
        real(made(obj), path)

    monkeypatch.setattr(streamsave, "save", eager)
    maker = Maker()
    obj, ref = sample(maker)
    atomic_torch_save(obj, tmp_path / "s.pt")
    assert same(torch.load(tmp_path / "s.pt", weights_only=True), ref)  # the same file...
    assert maker.most_alive > 1  # ...with every made tensor alive at once: the bound in the test above fails


def test_a_deferred_entry_of_another_shape_fails_and_leaves_no_file(tmp_path):
    obj = {"x": Deferred((3,), torch.float32, lambda: torch.zeros(4))}
    with pytest.raises(ValueError, match=r"made as \(4,\)"):
        atomic_torch_save(obj, tmp_path / "s.pt")
    assert list(tmp_path.iterdir()) == []


class Box:
    def __init__(self, t):
        self.t = t


def test_a_tensor_the_walk_cannot_reach_fails_and_leaves_no_file(tmp_path):
    obj = {"x": Deferred((3,), torch.float32, lambda: torch.zeros(3)), "box": Box(torch.ones(2))}
    with pytest.raises(RuntimeError, match="not filled"):
        atomic_torch_save(obj, tmp_path / "s.pt")
    assert list(tmp_path.iterdir()) == []


def test_an_object_without_deferred_entries_is_saved_by_torch_save(tmp_path, monkeypatch):
    monkeypatch.setattr(streamsave, "save", lambda *a, **k: pytest.fail("streamed without a deferred entry"))
    atomic_torch_save({"a": torch.ones(3)}, tmp_path / "s.pt")
    assert torch.equal(torch.load(tmp_path / "s.pt", weights_only=True)["a"], torch.ones(3))


class Pieces:
    """Deferred entries that can be made piece by piece; records each piece's bytes and every whole make."""

    def __init__(self) -> None:
        self.piece_bytes: list[int] = []
        self.made_whole = 0

    def __call__(self, value: torch.Tensor) -> Deferred:
        def make() -> torch.Tensor:
            self.made_whole += 1
            return value.clone()

        def piece(start: int, stop: int) -> torch.Tensor:
            t = value.reshape(-1)[start:stop].clone()
            self.piece_bytes.append(t.numel() * t.element_size())
            return t
        return Deferred(value.shape, value.dtype, make, piece)


def pieced_sample(pieces: Pieces) -> tuple[dict, dict]:
    torch.manual_seed(1)
    made = {"f": torch.randn(7, 2), "i": torch.arange(6), "nc": torch.randn(5, 6).T, "big": torch.randn(300, 50),
            "bf": torch.randn(9, 5).to(torch.bfloat16), "flag": torch.rand(11) > 0.5, "empty": torch.empty(0, 3),
            "scalar": torch.tensor(2.5)}
    obj = {"a": torch.randn(4, 4), "nested": [{k: pieces(v) for k, v in made.items()}]}
    # a deferred entry is written contiguous, whatever the strides of what it stands for
    return obj, {"a": obj["a"], "nested": [{k: v.contiguous() for k, v in made.items()}]}


def records(path) -> dict[str, bytes]:
    """Every record of the torch file at ``path`` by name, but the id torch draws afresh for each save; the archive's
    CRC-32s checked on the way."""
    with zipfile.ZipFile(path) as z:
        return {i.filename: z.read(i) for i in z.infolist() if not i.filename.endswith("serialization_id")}


@pytest.mark.parametrize("chunk", [1, 12, 13, 4096, None])
def test_entries_made_in_pieces_write_the_bytes_torch_save_writes(tmp_path, chunk):
    """Pieces of every size (one byte, a whole number of 4-byte elements, not one, more than any entry, the
    default): the file holds the bytes ``torch.save`` of the made object writes, record by record, no piece is larger than ``chunk`` (or
    than one element where ``chunk`` is smaller), and no entry is made whole."""
    pieces = Pieces()
    obj, ref = pieced_sample(pieces)
    (tmp_path / "ref").mkdir()
    streamsave.save(obj, tmp_path / "s.pt", chunk=chunk)
    torch.save(ref, tmp_path / "ref" / "s.pt")  # the same name: the archive's records are named after the file
    assert records(tmp_path / "s.pt") == records(tmp_path / "ref" / "s.pt")
    assert same(torch.load(tmp_path / "s.pt", weights_only=True), ref)
    assert pieces.made_whole == 0 and pieces.piece_bytes
    assert max(pieces.piece_bytes) <= max(chunk or streamsave.CHUNK_BYTES, 8)
    if chunk == 13:  # 3 fp32 elements a piece: the 600-element entry comes in 200 pieces
        assert pieces.piece_bytes.count(12) >= 200


def test_planted_a_writer_that_makes_pieced_entries_whole_breaks_the_bound(tmp_path, monkeypatch):
    real = streamsave._storage_pieces

    def whole(leaf, chunk):
        if isinstance(leaf, Deferred):
            leaf = Deferred(leaf.shape, leaf.dtype, leaf.make)
        yield from real(leaf, chunk)

    monkeypatch.setattr(streamsave, "_storage_pieces", whole)
    pieces = Pieces()
    obj, ref = pieced_sample(pieces)
    streamsave.save(obj, tmp_path / "s.pt", chunk=12)
    assert same(torch.load(tmp_path / "s.pt", weights_only=True), ref)  # the same file...
    assert pieces.made_whole > 0  # ...with whole entries made: the test above fails


def test_a_piece_of_another_shape_fails_and_leaves_no_file(tmp_path):
    obj = {"x": Deferred((4,), torch.float32, lambda: torch.zeros(4), lambda a, b: torch.zeros(b - a + 1))}
    with pytest.raises(ValueError, match=r"piece \[0, 4\) was made as \(5,\)"):
        atomic_torch_save(obj, tmp_path / "s.pt")
    assert list(tmp_path.iterdir()) == []


def test_a_chunk_below_one_byte_is_refused(tmp_path):
    with pytest.raises(ValueError, match="chunk must be at least 1 byte, not 0"):
        streamsave.save({"x": Deferred((1,), torch.float32, lambda: torch.zeros(1))}, tmp_path / "s.pt", chunk=0)
    assert list(tmp_path.iterdir()) == []
