"""The guarded table of torch internals (``patches.core.torch_internals``): each kind of entry holds or is refused.

The entries here point at a fake FSDP2-like module written to a temporary folder (so ``inspect.getsource`` reads
its classes as it reads torch's), never at torch itself: each test states what the fake class has and what the
check must say about it.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from patches.core.errors import UpstreamMismatch
from patches.core.torch_internals import INTERNALS, Internal, check, problem, require

FAKE = '''
class Group:
    def unshard(self, async_op=False):
        self.fsdp_params = []
        self.device = "cpu"

    def renamed(self, blocking=False):
        pass


class Stores:
    def __init__(self, other):
        self.kept = 1
        other.elsewhere = 2      # an attribute of another object, not of this class's instances
        self.a, self.b = 3, 4    # tuple targets count
        self.typed: int = 5      # annotated assignment counts

    def reads(self):
        return self.only_read    # read, never assigned


class WithClassAttr:
    defined_on_class = 0
'''


@pytest.fixture()
def fake(tmp_path, monkeypatch):
    """The module ``onecard_fake_fsdp`` (source above), importable and readable by ``inspect``."""
    (tmp_path / "onecard_fake_fsdp.py").write_text(textwrap.dedent(FAKE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "onecard_fake_fsdp", raising=False)
    return "onecard_fake_fsdp"


def _method(target: str, *params: tuple[str, ...]) -> Internal:
    return Internal("fake.method", target, "a test", params=params)


def _fields(target: str, *fields: tuple[str, ...]) -> Internal:
    return Internal("fake.fields", target, "a test", fields=fields)


def test_method_with_expected_parameter_names_holds_and_a_renamed_one_is_refused(fake):
    """``(self, async_op)`` expected: ``unshard(self, async_op)`` holds; ``renamed(self, blocking)`` -- the same
    count, another name -- is refused, the message naming what was found and what was expected."""
    assert problem(_method(f"{fake}:Group.unshard", ("self", "async_op"))) is None
    why = problem(_method(f"{fake}:Group.renamed", ("self", "async_op")))
    assert why == (f"{fake}:Group.renamed has parameters ('self', 'blocking'), expected ('self', 'async_op')")
    assert problem(_method(f"{fake}:Group.renamed", ("self",), ("self", "blocking"))) is None  # any listed list
    assert "is missing" in problem(_method(f"{fake}:Group.gone", ("self",)))


def test_fields_count_only_attributes_the_class_assigns_to_self(fake):
    """A field holds when the class's source assigns it to ``self`` (plain, tuple or annotated assignment) or the
    class defines it. An attribute stored on another object (``other.elsewhere = ...``) or only read
    (``return self.only_read``) is not one the instances carry: refused, named in the message."""
    for name in ("kept", "a", "b", "typed"):
        assert problem(_fields(f"{fake}:Stores", (name,))) is None, name
    assert problem(_fields(f"{fake}:WithClassAttr", ("defined_on_class",))) is None
    assert problem(_fields(f"{fake}:Stores", ("elsewhere",))) == f"{fake}:Stores no longer has elsewhere"
    assert problem(_fields(f"{fake}:Stores", ("only_read",))) == f"{fake}:Stores no longer has only_read"


def test_every_field_group_is_checked_and_alternatives_accept_any_one(fake):
    """Each inner tuple is one field, satisfied by any of its spellings; every group must hold. By hand: with
    groups ``(kept)``, ``(gone_x or b)``, ``(gone_y)`` only the last is missing; with ``(kept)``, ``(gone_z)`` the
    second -- not the first -- is the problem."""
    assert problem(_fields(f"{fake}:Stores", ("kept",), ("gone_x", "b"))) is None
    assert problem(_fields(f"{fake}:Stores", ("kept",), ("gone_x", "b"), ("gone_y",))) == \
        f"{fake}:Stores no longer has gone_y"
    assert problem(_fields(f"{fake}:Stores", ("kept",), ("gone_z",))) == f"{fake}:Stores no longer has gone_z"
    assert problem(_fields(f"{fake}:Stores", ("gone_1", "gone_2"), ("gone_3",))) == \
        f"{fake}:Stores no longer has gone_1 or gone_2, gone_3"


def test_require_raises_one_mismatch_naming_the_entry_and_the_torch_version(fake):
    """``require`` on a table with one failing entry raises UpstreamMismatch naming the torch version, the problem,
    the entry and the supported releases; ``check`` reports every entry."""
    import re

    import torch

    bad = _method(f"{fake}:Group.renamed", ("self", "async_op"))
    table = (_method(f"{fake}:Group.unshard", ("self", "async_op")), bad)
    assert [why is None for _, why in check(table)] == [True, False]
    with pytest.raises(UpstreamMismatch, match=rf"torch {re.escape(torch.__version__)}: .*Group.renamed has parameters.*"
                                               r"\(fake.method, used by a test\).*support torch"):
        require(table)


def test_the_real_table_holds_on_the_installed_torch():
    """The shipped table against the torch in this environment (one of the supported releases): every entry holds."""
    assert [(e.name, why) for e, why in check(INTERNALS) if why is not None] == []
