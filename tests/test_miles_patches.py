"""The miles-diffusion patch table (``patches/miles_table.py``) over a stand-in of upstream's FSDP application.

No miles-diffusion checkout can be installed here (it needs sglang and ray), so ``tests/fake_miles`` mirrors the
targets' module paths and signatures (``model_loader.apply_fsdp2``, ``checkpoint.broadcast_full_state_to_fsdp``,
and ``load_fsdp_models`` calling them through module globals, as upstream does); ``tests/fake_miles_changed`` has
an ``apply_fsdp2`` with another signature. Claims:

- flags off: nothing patched; ``MILES_ONECARD_FSDP=1``: both targets patched, reverted cleanly;
- a changed signature is refused by name before anything is patched (the planted mismatch);
- ``MILES_RESIDENT_BLOCKS`` without ``MILES_ONECARD_FSDP``, or with a bad value, is one clear flag error;
- the patched one-rank state load puts a given full state into the shards;
- the patched application trains what the stand-in's own does: tiny H3 + LoRA, one gloo rank, CPU offload, fp32,
  2 AdamW steps -- LoRA gradients and weights bitwise equal, with the offloaded shards in the exact arena
  (also with 1 of 4 blocks resident);
- the ``sitecustomize`` hook applies the table in a fresh process when the FSDP module is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from patches.core.flags import FlagError, read_miles
from patches.core.errors import UpstreamMismatch

from .cli import run_main

REPO = Path(__file__).resolve().parents[1]
FAKE = REPO / "tests" / "fake_miles"
CHANGED = REPO / "tests" / "fake_miles_changed"
ON = {"MILES_ONECARD_FSDP": True, "MILES_RESIDENT_BLOCKS": ""}


@pytest.fixture
def upstream(monkeypatch):
    """The stand-in on ``sys.path`` (fresh imports), removed afterwards."""
    def use(root: Path):
        for name in [m for m in sys.modules if m == "miles" or m.startswith("miles.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.syspath_prepend(str(root))
    yield use
    for name in [m for m in sys.modules if m == "miles" or m.startswith("miles.")]:
        del sys.modules[name]


def test_flags_off_patch_nothing_and_on_patch_both_then_revert(upstream):
    from patches.miles_table import patch_set

    upstream(FAKE)
    from miles.backends.fsdp_utils import checkpoint, model_loader

    orig = (model_loader.apply_fsdp2, checkpoint.broadcast_full_state_to_fsdp)
    ps = patch_set()
    assert ps.apply({"MILES_ONECARD_FSDP": False}) == []
    patched = ps.apply(ON)
    assert patched == ["miles.backends.fsdp_utils.model_loader:apply_fsdp2",
                       "miles.backends.fsdp_utils.checkpoint:broadcast_full_state_to_fsdp"]
    assert model_loader.apply_fsdp2._onecard_patch == "fsdp.apply_fsdp2"
    ps.revert()
    assert (model_loader.apply_fsdp2, checkpoint.broadcast_full_state_to_fsdp) == orig


def test_changed_signature_is_refused_by_name_and_nothing_is_patched(upstream):
    from patches.miles_table import patch_set

    upstream(CHANGED)
    from miles.backends.fsdp_utils import checkpoint, model_loader

    before = checkpoint.broadcast_full_state_to_fsdp
    with pytest.raises(UpstreamMismatch, match="model_loader:apply_fsdp2 has parameters .*offload_blocks.*MILES_ONECARD_FSDP"):
        patch_set().apply(ON)
    assert checkpoint.broadcast_full_state_to_fsdp is before and not hasattr(model_loader.apply_fsdp2, "_onecard_patch")


def test_flag_errors():
    assert read_miles({"MILES_ONECARD_FSDP": "1", "MILES_RESIDENT_BLOCKS": "auto"})["MILES_RESIDENT_BLOCKS"] == "auto"
    assert read_miles({"MILES_ONECARD_FSDP": "1", "MILES_RESIDENT_BLOCKS": "07"})["MILES_RESIDENT_BLOCKS"] == "7"
    with pytest.raises(FlagError, match="needs MILES_ONECARD_FSDP=1"):
        read_miles({"MILES_RESIDENT_BLOCKS": "3"})
    with pytest.raises(FlagError, match="MILES_RESIDENT_BLOCKS='half'"):
        read_miles({"MILES_ONECARD_FSDP": "1", "MILES_RESIDENT_BLOCKS": "half"})


# ------------------------------------------------------------- the patched application trains the same thing
ARGS = SimpleNamespace(diffusion_forward_dtype="fp32", fsdp_reduce_dtype="fp32")
PLAN = SimpleNamespace(no_split_modules=["MiniMaxH3TransformerBlock", "MiniMaxH3TokenRefinerBlock",
                                         "MiniMaxH3AdaLayerNormOut"], param_dtype_patterns={})


def _train(model_loader) -> dict:
    from tests.equivalence.h3_ranks import cpu_mesh
    from miles_ext.levers.lora import lora_parameters
    from miles_ext.recipe.schedule import pair_schedule
    from miles_ext.recipe.sft import train_step
    from tests.equivalence.h3_tiny_run import OPTIM, make_lora_model, synthetic_pairs

    pairs = synthetic_pairs(8)
    model = make_lora_model()
    model_loader.load_fsdp_models(model, PLAN, cpu_mesh(), cpu_offload=True, args=ARGS)
    lora = lora_parameters(model)
    opt = torch.optim.AdamW(list(lora.values()), **OPTIM)
    grads: dict = {}

    def snap():
        if not grads:
            grads.update({n: p.grad.full_tensor().clone() for n, p in lora.items()})

    for slots in pair_schedule(4, 1, 2, 1)[:2]:
        train_step(model, opt, slots, pairs, seed=5, max_grad_norm=0.05, after_backward=snap)
    from miles_ext.levers.pinned import pinned_report

    rep = pinned_report(model)
    return {"grads": grads, "weights": {n: p.full_tensor().detach().clone() for n, p in lora.items()},
            "arena": rep.requested_bytes if rep else 0}


def _loads_given_state(model_loader, checkpoint) -> bool:
    """The patched state load puts the *given* full state into the shards (a state unlike the model's own)."""
    from tests.equivalence.h3_ranks import cpu_mesh
    from tests.equivalence.h3_tiny_run import make_lora_model

    model = make_lora_model()
    wanted = {k: v * 2 + 1 for k, v in model.state_dict().items()}
    model_loader.apply_fsdp2(model, PLAN, mesh=cpu_mesh(), cpu_offload=True, args=ARGS)
    checkpoint.broadcast_full_state_to_fsdp(model, wanted, cpu_offload=True)
    got = model.state_dict()
    return all(torch.equal(getattr(got[k], "full_tensor", lambda: got[k])(), v) for k, v in wanted.items())


def _worker(rank: int, world: int, out_dir: str, fake: str) -> None:
    sys.path.insert(0, fake)
    from miles.backends.fsdp_utils import checkpoint, model_loader
    from patches.miles_table import patch_set

    res = {"stand-in": _train(model_loader)}
    ps = patch_set()
    ps.apply(ON)
    res["patched"] = _train(model_loader)
    os.environ["MILES_RESIDENT_BLOCKS"] = "1"
    res["patched_resident1"] = _train(model_loader)
    res["calls"] = list(checkpoint.calls)
    res["loads_given_state"] = _loads_given_state(model_loader, checkpoint)
    ps.revert()
    torch.save(res, Path(out_dir) / "miles.pt")


def test_patched_application_trains_the_same(tmp_path):
    from tests.equivalence.h3_ranks import launch

    launch(_worker, 1, str(tmp_path), str(FAKE))
    res = torch.load(tmp_path / "miles.pt")
    ref = res["stand-in"]
    assert res["calls"] == ["stand-in"]  # the patched runs did not go through the stand-in's state load
    assert res["loads_given_state"]
    for mode in ("patched", "patched_resident1"):
        assert res[mode]["arena"] > 0, mode
        for part in ("grads", "weights"):
            assert all(torch.equal(res[mode][part][k], v) for k, v in ref[part].items()), (mode, part)


def test_sitecustomize_hook_patches_on_import():
    env = dict(os.environ, MILES_DIFFUSION_ROOT=str(FAKE), MILES_ONECARD_FSDP="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "patches" / "miles_site"), str(REPO), str(FAKE)]))
    code = ("import miles.backends.fsdp_utils.model_loader as m, miles.backends.fsdp_utils.checkpoint as c; "
            "print(m.apply_fsdp2._onecard_patch, c.broadcast_full_state_to_fsdp._onecard_patch)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["fsdp.apply_fsdp2", "fsdp.broadcast_full_state"]
    env["MILES_ONECARD_FSDP"] = "0"
    out = subprocess.run([sys.executable, "-c", "import miles.backends.fsdp_utils.model_loader as m; "
                          "print(hasattr(m.apply_fsdp2, '_onecard_patch'))"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def _launch(env_extra: dict, *args: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")}
    env.update(env_extra)
    return subprocess.run(["bash", str(REPO / "launchers" / "sft_h3_t2va_1gpu.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def test_launcher_runs_an_upstream_checkout_patched(tmp_path):
    import shutil

    root = tmp_path / "miles_diffusion"
    shutil.copytree(FAKE, root)
    (root / "train_diffusion.py").write_text(
        "import sys\nimport miles.backends.fsdp_utils.model_loader as m\n"
        "print('args', *sys.argv[1:], getattr(m.apply_fsdp2, '_onecard_patch', None))\n")
    out = _launch({"MILES_DIFFUSION_ROOT": str(root), "MILES_ONECARD_FSDP": "1"}, "--train-only")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["args", "--train-only", "fsdp.apply_fsdp2"]


def test_launcher_refuses_a_folder_that_is_not_a_checkout_and_bad_flags(tmp_path):
    out = _launch({"MILES_DIFFUSION_ROOT": str(tmp_path)})
    assert out.returncode == 2 and "is not a miles-diffusion checkout" in out.stderr
    root = tmp_path / "m"
    (root / "miles" / "backends" / "fsdp_utils").mkdir(parents=True)
    (root / "train_diffusion.py").write_text("")
    out = _launch({"MILES_DIFFUSION_ROOT": str(root), "MILES_RESIDENT_BLOCKS": "4"})
    assert out.returncode == 2 and "error: MILES_RESIDENT_BLOCKS needs MILES_ONECARD_FSDP=1" in out.stderr


def test_status_reports_the_miles_table():
    """``python -m patches status`` shows the miles flags and, with MILES_DIFFUSION_ROOT, each target's state (in this
    process: :func:`tests.cli.run_main` with the stand-in checkout's ``miles`` package isolated)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MILES_", "COSMOS_"))}
    env["PYTHONPATH"] = str(REPO)

    def status(**extra: str) -> subprocess.CompletedProcess:
        return run_main("patches.__main__", ["status"], {**env, **extra}, REPO, isolate=("miles",))

    before = {n: m for n, m in sys.modules.items() if n.partition(".")[0] == "miles"}
    r = status(MILES_DIFFUSION_ROOT=str(FAKE))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MILES_ONECARD_FSDP=0" in r.stdout and "fsdp.apply_fsdp2" in r.stdout and "MISMATCH" not in r.stdout
    r = status(MILES_DIFFUSION_ROOT=str(REPO / "tests" / "fake_miles_changed"), MILES_ONECARD_FSDP="1")
    assert r.returncode == 2 and "MISMATCH" in r.stdout and r.stderr.count("error:") == 1
    r = status(MILES_DIFFUSION_ROOT=str(REPO / "tests"))
    assert r.returncode == 2 and "not a miles-diffusion checkout" in r.stderr
    assert {n: m for n, m in sys.modules.items() if n.partition(".")[0] == "miles"} == before  # none left behind


