"""The guarded monkeypatch machinery (no upstream needed): verify, refuse by name, apply, revert."""

from __future__ import annotations

import sys
import types

import pytest

from patches.core.flags import EMA_CPU_SUBSET, VAE_CPU_OFFLOAD
from patches.guard import MARK, Patch, PatchSet, UpstreamMismatch


@pytest.fixture()
def fake_upstream(monkeypatch):
    mod = types.ModuleType("fake_upstream_mod")

    class Model:
        def set_up(self):
            return "original set_up"

        def encode(self, state):
            return ("original encode", state)

    mod.Model = Model
    mod.ema_impl, mod.vae_impl = _wrap("ema"), _wrap("vae")  # implementations, named by import string
    monkeypatch.setitem(sys.modules, "fake_upstream_mod", mod)
    return mod


def _wrap(tag):
    def factory(original):
        def replacement(self, *a, **k):
            return (tag, original(self, *a, **k))

        return replacement

    return factory


def _table(signature=(("self",),)):
    return PatchSet("fake", "fake@abc123", [
        Patch("ema.set_up", EMA_CPU_SUBSET, "fake_upstream_mod:Model.set_up", signature, "fake_upstream_mod:ema_impl"),
        Patch("vae.encode", VAE_CPU_OFFLOAD, "fake_upstream_mod:Model.encode", (("self", "state"),), "fake_upstream_mod:vae_impl"),
    ])


def test_apply_only_flagged_patches_then_revert(fake_upstream):
    original_set_up, original_encode = fake_upstream.Model.set_up, fake_upstream.Model.encode
    ps = _table()
    assert ps.apply({EMA_CPU_SUBSET.name: True}) == ["fake_upstream_mod:Model.set_up"]
    m = fake_upstream.Model()
    assert m.set_up() == ("ema", "original set_up")
    assert m.encode(1) == ("original encode", 1)  # flag off: untouched
    assert fake_upstream.Model.encode is original_encode
    assert getattr(fake_upstream.Model.set_up, MARK) == "ema.set_up"
    assert [s for s in ps.status() if s[2]] == [("ema.set_up", "fake_upstream_mod:Model.set_up", True)]
    ps.apply({EMA_CPU_SUBSET.name: True})  # idempotent: not wrapped twice
    assert m.set_up() == ("ema", "original set_up")
    ps.revert()
    assert fake_upstream.Model.set_up is original_set_up


def test_no_flags_leave_upstream_untouched(fake_upstream):
    before = dict(vars(fake_upstream.Model))
    assert _table().apply({}) == []
    assert dict(vars(fake_upstream.Model)) == before


def test_changed_signature_is_refused_by_name_and_nothing_is_patched(fake_upstream):
    original = fake_upstream.Model.encode
    fake_upstream.Model.set_up = lambda self, extra: None  # upstream changed set_up's signature
    with pytest.raises(UpstreamMismatch) as e:
        _table().apply({EMA_CPU_SUBSET.name: True, VAE_CPU_OFFLOAD.name: True})
    msg = str(e.value)
    assert "fake_upstream_mod:Model.set_up" in msg and "('self', 'extra')" in msg and "fake@abc123" in msg
    assert fake_upstream.Model.encode is original  # all targets are checked before any change


def test_missing_target_is_refused(fake_upstream):
    del fake_upstream.Model.encode
    with pytest.raises(UpstreamMismatch, match="Model.encode does not exist"):
        _table().apply({VAE_CPU_OFFLOAD.name: True})
    with pytest.raises(UpstreamMismatch, match="cannot import"):
        PatchSet("x", "y", [Patch("p", EMA_CPU_SUBSET, "no_such_module_xyz:f", (("a",),), "no_such_module_xyz:impl")]).apply(
            {EMA_CPU_SUBSET.name: True})


def test_any_listed_signature_is_accepted(fake_upstream):
    fake_upstream.Model.set_up = lambda self, extra=None: "new"
    ps = _table(signature=(("self",), ("self", "extra")))
    assert ps.apply({EMA_CPU_SUBSET.name: True}) == ["fake_upstream_mod:Model.set_up"]
    ps.revert()


def test_cosmos_table_names_real_targets():
    from patches.cosmos_table import PATCHES, SUPPORTED

    assert "ed8287f" in SUPPORTED and "5eee9ed" in SUPPORTED
    assert {p.flag.name for p in PATCHES} == {EMA_CPU_SUBSET.name, VAE_CPU_OFFLOAD.name}
    assert all(p.target.startswith("cosmos_framework.") for p in PATCHES)
