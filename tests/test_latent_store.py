"""The shared latent store, :mod:`patches.core.data.latents`: what its docstrings promise about entries and key parts,
checked on tiny tensors and files (no encoder, no video decode).

- an entry of several tensors loads back verified, whatever order they were handed in or come back in;
- :func:`file_sha256` is the SHA-256 of the file's bytes (``hashlib`` on the same bytes): a same-size rewrite in
  place, a same-size replacement under the same mtime, each gets the new bytes' digest where documented;
- :func:`module_fingerprint` leaves config keys starting with ``_`` out (diffusers' ``_use_default_values`` is a set
  whose printed order changes per process), so two processes agree on it.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
from torch import nn

from patches.core.data import latents


def _tensors() -> dict[str, torch.Tensor]:
    """Three named tensors of different dtypes and sizes, handed in out of name order."""
    return {
        "zeta": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "alpha": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "mid": torch.arange(5, dtype=torch.int64),
    }


def test_a_multi_tensor_entry_loads_back_verified(tmp_path):
    """Stored with its tensors in the order ``zeta, alpha, mid`` (not name order; safetensors hands them back in name
    order), the entry must load back without :class:`CorruptEntry`, every tensor equal to what was stored, and the
    stored checksum must not depend on the order the tensors were given: the same tensors given in reverse order
    under another key store the same ``sha256`` metadata."""
    store = latents.LatentStore(tmp_path)
    key = latents.make_key({"clip": "a", "window": [0, 5]})
    src = _tensors()
    store.store(key, src, {"note": "x"})
    got, meta = store.load(key)
    assert sorted(got) == ["alpha", "mid", "zeta"] and meta["note"] == "x"
    assert all(got[n].dtype == src[n].dtype and torch.equal(got[n], src[n]) for n in src)
    other = latents.make_key({"clip": "b"})
    store.store(other, dict(reversed(list(src.items()))))
    got2, meta2 = store.load(other)
    assert meta2["sha256"] == meta["sha256"] and all(torch.equal(got2[n], src[n]) for n in src)


def test_file_digest_follows_a_same_size_rewrite(tmp_path, monkeypatch):
    """:func:`file_sha256` must equal ``hashlib.sha256`` of the file's current bytes after the file is rewritten in
    place with other bytes of the same size (same path, size and inode; a new mtime, as any write gives it: set
    explicitly here, one second later, so a coarse file-system clock cannot hide it). A replacement by a new file
    (another inode) of the same size and the same mtime gets its own digest too. Under the same path, size, mtime
    and inode the memo may answer within one process, but not in the next one (an empty memo, as a new process
    starts with)."""
    clip = tmp_path / "clip.bin"
    old, new, newer = b"A" * 64, b"B" * 64, b"C" * 64
    clip.write_bytes(old)
    assert latents.file_sha256(clip) == hashlib.sha256(old).hexdigest()
    st = os.stat(clip)
    with open(clip, "r+b") as f:  # in place: the inode stays
        f.write(new)
    os.utime(clip, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert os.stat(clip).st_ino == st.st_ino and os.stat(clip).st_size == st.st_size
    assert latents.file_sha256(clip) == hashlib.sha256(new).hexdigest()

    st = os.stat(clip)
    tmp = tmp_path / "clip.tmp"
    tmp.write_bytes(newer)
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime, another inode
    os.replace(tmp, clip)
    assert latents.file_sha256(clip) == hashlib.sha256(newer).hexdigest()

    monkeypatch.setattr(latents, "_FILE_SHA", {})  # what a new process starts with
    assert latents.file_sha256(clip) == hashlib.sha256(newer).hexdigest()


class _Coder(nn.Module):
    """A stand-in encoder with a diffusers-style ``config`` (a dict here)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(2, 3)
        self.config = config


def test_fingerprint_leaves_private_config_keys_out():
    """The docstring of :func:`module_fingerprint`: ``config`` is the module's config as sorted JSON with keys starting
    with ``_`` left out. Expected ``config`` written out by hand for ``{"z_dim": 4, "mean": [0.5, 1]}``; a set under
    ``_use_default_values`` (whose printed order depends on the process's hash seed) and any other ``_`` key must
    not change the fingerprint at all, so that two processes agree."""
    plain = latents.module_fingerprint(_Coder({"z_dim": 4, "mean": [0.5, 1]}), torch.float32, "cpu")
    assert plain["config"] == '{"mean": [0.5, 1], "z_dim": 4}'
    assert json.loads(plain["config"]) == {"mean": [0.5, 1], "z_dim": 4}
    noisy = latents.module_fingerprint(
        _Coder({"z_dim": 4, "mean": [0.5, 1], "_use_default_values": {"latents_std", "z_dim", "base_dim"},
                "_name_or_path": "/somewhere/else"}), torch.float32, "cpu")
    assert noisy == plain
    assert latents.module_fingerprint(_Coder({"z_dim": 8, "mean": [0.5, 1]}), torch.float32, "cpu") != plain
