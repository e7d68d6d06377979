"""The mutation list (``tests/mutation/mutants.toml``) stays valid: every snippet is found exactly once in the source
it names (inside the function it is anchored to), every named test exists, and the list covers every planted bug the
docs name, every kind of bug a mutation run found surviving and every kind of the independent list. Fast (no test
is run); ``python tests/mutation/run.py`` runs the mutants."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mutation import run as mutation

README_PLANTED_BUGS = {
    "bf16 shadow", "wrong beta", "skipped update", "read before copy event", "dtype change on park",
    "unpark without copy", "<= fit rule", "no look-ahead", "per-token mean", "missing ÷ grad_accum",
    "missing segment masks", "world-size term in the batch",
    "per-micro-batch mean instead of loss_sum/num_local_pairs", "wrong seed mapping", "bf16 adapters",
    "plain PEFT init on a bf16 base", "vision token sees the next sample's text",
    "latent cache key ignores the window", "latent cache stores bf16", "optimizer state streamed through bf16",
    "one optimizer stream group skipped", "frozen fp32 values lost at save", "non-finite gradient poisons the adapters",
    "non-finite loss", "non-finite: ranks decide alone", "H3 latents not normalised", "H3 pixel convention",
    "ComfyUI fc1 half order", "ComfyUI fused qkv", "block mask: causal diagonal tile marked full",
    "compiled blocks: a recompile per micro-batch length",
    "exact pinned memory: the 5 % check accepts the power-of-two rounding",
    "exact pinned arena: a shard rebound without its values",
    "a recomputed input from the wrong block", "a dropped input still kept",
    "adapters gathered behind the next block's copy",
    "lockstep: a block resharded after every micro-batch's forward", "lockstep: gradients summed by autograd",
    "lockstep: settings not restored after a failure", "lockstep: losses out of order", "missing stream wait",
    "lockstep: the backward started at the caller's losses",
    "adapter step: a moment streamed through bf16", "adapter step: a parameter not written back",
    "adapter step: a stream group skipped", "adapter step: missing stream wait",
    "text stream: detached although embed_tokens trains", "text stream: the vision stream detached too",
    "variable-length gather: vision sees the next sample's text",
}
SURVIVOR_KINDS = {  # what survived a mutation run before the independent anchors existed
    "EMA update rule", "trainer beta(iteration - 1)", "resume loses the EMA counter",
    "VAE encode: posterior sample instead of mean", "loss scale", "sum instead of mean over samples",
    "velocity target sign", "H3 gradient scale", "bf16 adapters (trainer call order)", "adapter compute dtype",
    "ComfyUI alpha", "CUDA ordering: optimizer pre-step wait", "CUDA ordering: copy after the optimizer step",
    "drop counter",
}
INDEPENDENT_KINDS = {  # the kinds of an independent list written from the source alone, without reading the tests
    "checkpoint ordering", "checkpoint marker names an incomplete file", "cleaning temporaries",
    "optimizer streaming several param groups", "optimizer streaming amsgrad", "optimizer streaming per-group selection",
    "pinned tolerance check", "power-of-two helper", "residency select_resident", "residency prefetch wiring",
    "residency memory model", "H3 init distributions", "H3 init per-parameter seeding",
    "attention LSE of a row that sees no key", "export dtype", "translator multi-node GPU count",
    "latent cache shape check", "run lock from another host", "run lock from another user's process",
    "resume setting boolean vs integer", "pre-flight NaN lower bound", "pre-flight broken symlink",
    "guard renamed parameter", "guard revert leaves a patch registered",
}
VALIDATION_KINDS = {  # bad input of the right type: a test per kind, each with its planted check (tests/test_validation.py)
    "validation: checkpoint of another run", "validation: storage fault", "validation: run gone wrong",
    "validation: setting not honoured", "validation: file contents by meaning", "validation: run lock",
}


@pytest.fixture(scope="module")
def mutants() -> list[mutation.Mutant]:
    return mutation.load_mutants()


def test_every_snippet_is_found_once_and_every_test_exists(mutants):
    assert len(mutants) >= 45
    assert mutation.problems(mutants) == []


def test_the_list_covers_the_planted_bugs_and_the_survivors(mutants):
    kinds = {m.kind for m in mutants}
    assert README_PLANTED_BUGS - kinds == set()
    assert SURVIVOR_KINDS - kinds == set()
    assert INDEPENDENT_KINDS - kinds == set()
    assert VALIDATION_KINDS - kinds == set()
    assert {m.kind for m in mutants if m.cuda} >= {k for k in SURVIVOR_KINDS if k.startswith("CUDA")}


def test_a_stale_snippet_is_refused(tmp_path: Path):
    (tmp_path / "m.py").write_text("x = 1\nx = 1\n")
    twice = mutation.Mutant("twice", "k", "m.py", "<module>", "x = 1", "x = 2", ("t",))
    absent = mutation.Mutant("absent", "k", "m.py", "<module>", "y = 1", "y = 2", ("t",))
    for m in (twice, absent):
        with pytest.raises(mutation.StaleList, match="needs exactly 1"):
            mutation.apply(m, tmp_path)
    assert (tmp_path / "m.py").read_text() == "x = 1\nx = 1\n"
    once = mutation.Mutant("once", "k", "m.py", "<module>", "x = 1\nx", "x = 3\nx", ("t",))
    mutation.apply(once, tmp_path)
    assert (tmp_path / "m.py").read_text() == "x = 3\nx = 1\n"
    gone = mutation.Mutant("gone", "k", "m.py", "f", "x = 3", "x = 4", ("t",))
    with pytest.raises(mutation.StaleList, match="has no function f"):
        mutation.apply(gone, tmp_path)


def test_a_mutant_is_anchored_to_its_function(tmp_path: Path):
    """The same line in another function, and edits outside the mutant's function, leave it valid; only its own
    function's copy changes."""
    src = "def f():\n    return 1\n\n\nclass C:\n    def g(self):\n        return 1\n"
    (tmp_path / "m.py").write_text(src)
    m = mutation.Mutant("g", "k", "m.py", "C.g", "return 1", "return 2", ("t",))
    mutation.apply(m, tmp_path)
    assert (tmp_path / "m.py").read_text() == src.replace("        return 1", "        return 2")
    edited = "import os\n\n\n" + src.replace("def f():", "def f(a=1):")  # a reformat elsewhere
    (tmp_path / "m.py").write_text(edited)
    assert mutation.problems([m], tmp_path) == ["mutant g: test t does not exist"]
    assert mutation.innermost_function(src, src.index("        return 1")) == "C.g"
    assert mutation.innermost_function(src, 0) == "f" and mutation.innermost_function("x = 1\n", 0) == "<module>"


def test_node_ids_are_checked():
    assert mutation.node_exists("tests/mutation/test_mutants.py::test_node_ids_are_checked")
    assert mutation.node_exists("tests/equivalence/test_ema.py::test_update_rule_by_hand[device]")
    assert not mutation.node_exists("tests/mutation/test_mutants.py::test_no_such_test")
    assert not mutation.node_exists("tests/no_such_file.py::test_x")
    assert mutation.node_exists("tests/mutation/test_mutants.py")  # a whole test file
    assert not mutation.node_exists("tests/mutation/run.py")  # not a test file
