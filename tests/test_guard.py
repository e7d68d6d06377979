"""The guarded monkeypatch machinery (no upstream needed): verify, refuse by name, apply, revert."""

from __future__ import annotations

import sys
import types

import pytest

from patches.core.flags import ATTN_BACKEND, EMA_CPU_SUBSET, OPTIM_STATE_OFFLOAD, VAE_CPU_OFFLOAD
from patches.core.errors import UpstreamMismatch
from patches.guard import MARK, Patch, PatchSet

from tests.cli import run_main
from tests.cosmos_stub import write_checkout


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


def test_a_patch_that_two_levers_need_is_applied_for_either_and_once_for_both(fake_upstream):
    from patches.core.flags import FROZEN_BF16

    original = fake_upstream.Model.set_up
    ps = PatchSet("fake", "fake@abc123", [Patch("shared.set_up", EMA_CPU_SUBSET, "fake_upstream_mod:Model.set_up",
                                                (("self",),), "fake_upstream_mod:ema_impl", also=(FROZEN_BF16,))])
    assert ps.apply({}) == []
    for flags in ({FROZEN_BF16.name: True}, {EMA_CPU_SUBSET.name: True, FROZEN_BF16.name: True}):
        assert ps.apply(flags) == ["fake_upstream_mod:Model.set_up"]
        assert fake_upstream.Model().set_up() == ("ema", "original set_up")  # wrapped once
        assert ps.status() == [("shared.set_up", "fake_upstream_mod:Model.set_up", True)]
        ps.revert()
        assert fake_upstream.Model.set_up is original


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



def test_renamed_parameter_with_the_same_count_is_refused(fake_upstream):
    """The check compares parameter *names*, not their count: ``encode(self, latent)`` where the table expects
    ``(self, state)`` is another function (a keyword caller would break) and is refused by name."""
    fake_upstream.Model.encode = lambda self, latent: latent
    with pytest.raises(UpstreamMismatch, match=r"Model.encode has parameters \('self', 'latent'\), expected "
                                               r"\('self', 'state'\)"):
        _table().apply({VAE_CPU_OFFLOAD.name: True})
    assert getattr(fake_upstream.Model.encode, MARK, None) is None  # nothing patched


def test_revert_undoes_registry_side_effects_after_restoring_the_original(fake_upstream):
    """A replacement that also registered itself somewhere (as the attention backend patch does in upstream's
    ``BACKEND_MAP``) carries ``onecard_undo``; ``revert`` calls it, so the registry is as before the apply, and
    calls it once the original is back on its target (the undo sees the original)."""
    registry = {"stock": "stock-backend"}
    seen_at_undo = []

    def registering(original):
        def replacement(self, *a, **k):
            return ("reg", original(self, *a, **k))

        def undo():
            seen_at_undo.append(fake_upstream.Model.set_up)
            del registry["onecard"]

        registry["onecard"] = replacement
        replacement.onecard_undo = undo
        return replacement

    fake_upstream.registering = registering
    original = fake_upstream.Model.set_up
    ps = PatchSet("fake", "fake@abc123", [Patch("reg.set_up", EMA_CPU_SUBSET, "fake_upstream_mod:Model.set_up",
                                                (("self",),), "fake_upstream_mod:registering")])
    ps.apply({EMA_CPU_SUBSET.name: True})
    assert set(registry) == {"stock", "onecard"} and fake_upstream.Model().set_up() == ("reg", "original set_up")
    ps.revert()
    assert registry == {"stock": "stock-backend"} and seen_at_undo == [original]
    assert fake_upstream.Model.set_up is original


def test_revert_restores_newest_first(fake_upstream):
    """Two patches stacked on one target (the second wraps the first): ``revert`` must undo the newest first, so the
    target ends as the upstream original (oldest first would leave the first patch installed), and the undo hooks
    run newest first. Expected by hand: calls ``b(a(original))`` while applied; undo order b, a; then the original."""
    log = []

    def tagged(tag):
        def factory(original):
            def replacement(self, *a, **k):
                return (tag, original(self, *a, **k))

            replacement.onecard_undo = lambda: log.append(tag)
            return replacement

        return factory

    fake_upstream.impl_a, fake_upstream.impl_b = tagged("a"), tagged("b")
    original = fake_upstream.Model.set_up
    ps = PatchSet("fake", "fake@abc123", [
        Patch("a.set_up", EMA_CPU_SUBSET, "fake_upstream_mod:Model.set_up", (("self",),), "fake_upstream_mod:impl_a"),
        Patch("b.set_up", VAE_CPU_OFFLOAD, "fake_upstream_mod:Model.set_up", (("self",),), "fake_upstream_mod:impl_b"),
    ])
    ps.apply({EMA_CPU_SUBSET.name: True})
    ps.apply({VAE_CPU_OFFLOAD.name: True})
    assert fake_upstream.Model().set_up() == ("b", ("a", "original set_up"))
    ps.revert()
    assert log == ["b", "a"]
    assert fake_upstream.Model.set_up is original and fake_upstream.Model().set_up() == "original set_up"


def test_cosmos_table_names_real_targets():
    from patches.cosmos_table import PATCHES, SUPPORTED

    assert "ed8287f" in SUPPORTED and "5eee9ed" in SUPPORTED
    from patches.core.flags import DETACH_TEXT_STREAM, FROZEN_BF16, LATENT_CACHE

    assert {p.flag.name for p in PATCHES} == {EMA_CPU_SUBSET.name, VAE_CPU_OFFLOAD.name, ATTN_BACKEND.name,
                                              OPTIM_STATE_OFFLOAD.name, FROZEN_BF16.name, LATENT_CACHE.name,
                                              DETACH_TEXT_STREAM.name}
    assert all(p.target.startswith("cosmos_framework.") for p in PATCHES)


def test_inherited_only_target_is_refused_by_name(fake_upstream):
    """Upstream stops defining the method on the class; a base's stub with the same signature must not pass."""

    class Base:
        def set_up(self):
            return "stub"

    class Model(Base):
        def encode(self, state):
            return state

    fake_upstream.Model = Model
    with pytest.raises(UpstreamMismatch, match="no longer defined by .*Model itself.*fake@abc123"):
        _table().apply({EMA_CPU_SUBSET.name: True})
    assert Base.set_up(Model()) == "stub" and "set_up" not in vars(Model)  # nothing was patched


def test_missing_target_error_names_the_supported_commits(fake_upstream):
    del fake_upstream.Model.encode
    with pytest.raises(UpstreamMismatch, match="does not exist.*fake@abc123"):
        _table().apply({VAE_CPU_OFFLOAD.name: True})


@pytest.mark.parametrize("with_methods, code", [(True, 0), (False, 2)])
def test_status_exit_code_follows_the_targets(tmp_path, with_methods, code):
    import os

    write_checkout(tmp_path, with_methods)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSMOS_")}
    env.update(COSMOS_FRAMEWORK_ROOT=str(tmp_path), COSMOS_EMA_CPU_SUBSET="1")
    r = run_main("patches.__main__", ["status"], env, tmp_path, isolate=("cosmos_framework",))
    assert r.returncode == code, r.stdout + r.stderr
    assert ("MISMATCH" in r.stdout) == (code != 0)
    if code:
        assert r.stderr.count("error:") == 1 and "ed8287f" in r.stderr


@pytest.mark.parametrize("body", ["def broken(:\n", "raise RuntimeError('needs a GPU at import')\n"])
def test_a_checkout_module_that_fails_to_import_is_named_not_a_traceback(tmp_path, body):
    import os

    write_checkout(tmp_path, True)
    (tmp_path / "cosmos_framework" / "checkpoint" / "dcp.py").write_text(body)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSMOS_")}
    env.update(COSMOS_FRAMEWORK_ROOT=str(tmp_path), COSMOS_EMA_CPU_SUBSET="1")
    r = run_main("patches.__main__", ["status"], env, tmp_path, isolate=("cosmos_framework",))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "importing cosmos_framework.checkpoint.dcp failed" in r.stdout and "ed8287f" in r.stdout
