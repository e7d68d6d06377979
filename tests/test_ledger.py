"""The memory ledger: exact where it claims to be, a clear error on bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cosmos_framework_ext.recipe import config as cfgmod
from cosmos_framework_ext.recipe.ledger import cosmos_ledger
from patches import ledger as ledgermod
from patches.core.ledger import parse_budget
from tests.equivalence import tiny_recipe as R

REPO = Path(__file__).resolve().parents[1]
TOML = REPO / "toml" / "vision_sft_edge_24gb.toml"
LEVERS = {"COSMOS_EMA_CPU_SUBSET": True, "COSMOS_VAE_CPU_OFFLOAD": True}


def _items(led):
    return {i.name.split(" (")[0]: i for i in led.items}


def test_tiny_ledger_equals_bytes_allocated_after_one_step():
    """Weights, gradients and AdamW state: the ledger's bytes are the bytes that exist (CPU, fp32)."""
    led = _items(cosmos_ledger(cfgmod.load(TOML), "tiny", LEVERS, device_type="cpu"))
    model, _ = R.make_model()
    opt = R.make_optimizer(model)
    R.loss_of(model, R.micro_batch(0, 0)).backward()
    opt.step()
    weights = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    state = sum(t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    assert led["weights"].gpu_bytes == weights
    assert led["gradients"].gpu_bytes == grads
    assert led["AdamW state"].gpu_bytes == state


def test_edge_components_are_the_recipe_sizes():
    led = _items(cosmos_ledger(cfgmod.load(TOML), "edge", {}, device_type="cuda"))
    assert led["weights"].gpu_bytes == 3_361_198_784 * 2 + 64 * 4  # bf16 + the fp32 rotary buffer
    assert led["gradients"].gpu_bytes == 1_414_924_992 * 2
    assert led["EMA"].gpu_bytes == 3_361_198_784 * 4  # stock: fp32 clone of everything
    assert led["Wan2.2 VAE"].gpu_bytes == 704_688_668 * 2


def test_levers_move_ema_and_vae_to_pinned_host():
    cfg = cfgmod.load(TOML)
    stock = cosmos_ledger(cfg, "edge", {}, device_type="cuda")
    both = cosmos_ledger(cfg, "edge", LEVERS, device_type="cuda")
    saved = stock.gpu_allocated - both.gpu_allocated
    assert saved == 3_361_198_784 * 4 + 704_688_668 * 2
    assert both.pinned_bytes == 1_414_924_992 * (4 + 2) + 704_688_668 * 2
    budget = parse_budget("22.06")
    assert both.fits(budget) and not stock.fits(budget)


def test_cli_fit_and_no_fit(capsys, monkeypatch):
    for f in LEVERS:
        monkeypatch.setenv(f, "1")
    assert ledgermod.main(["--toml", str(TOML), "--budget-gib", "22.06"]) == 0
    assert "FITS" in capsys.readouterr().out
    for f in LEVERS:
        monkeypatch.delenv(f)
    assert ledgermod.main(["--toml", str(TOML), "--budget-gib", "22.06"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "to fit: set COSMOS_EMA_CPU_SUBSET=1" in out


@pytest.mark.parametrize("budget", ["-1", "0", "abc", "nan"])
def test_bad_budget_is_one_clear_error(capsys, budget):
    assert ledgermod.main(["--toml", str(TOML), "--budget-gib", budget]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --budget-gib")


def test_unknown_toml_is_one_clear_error(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(TOML.read_text() + "\n[surprise]\nx = 1\n")
    assert ledgermod.main(["--toml", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown table [surprise]" in err[0]
    assert ledgermod.main(["--toml", str(tmp_path / "missing.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_save_and_the_host_baseline_on_the_host_column():
    """One rank streams the save (one piece of at most 64 MiB at a time, where the largest tensor's fp32 copy is
    1 GiB; a tiny model's whole largest tensor); several gather full copies; a CPU run does not print the GPU
    machine's measured baseline as its own."""
    cfg = cfgmod.load(TOML)
    one = _items(cosmos_ledger(cfg, "edge", LEVERS, device_type="cuda"))
    meta = R.build_transformer(R.get_preset("edge"), device="meta")
    assert max(p.numel() for p in meta.parameters()) * 4 == 2**30  # embed_tokens / lm_head in fp32
    assert one["checkpoint save"].host_bytes == 64 * 2**20 and "streamed" in one["checkpoint save"].name
    tiny = R.build_transformer(R.get_preset("tiny"), device="meta")
    assert (_items(cosmos_ledger(cfg, "tiny", LEVERS, device_type="cpu"))["checkpoint save"].host_bytes
            == max(p.numel() for p in tiny.parameters()) * 4)
    two = _items(cosmos_ledger(cfg, "edge", LEVERS, world_size=2, device_type="cuda"))
    assert "gathered" in two["checkpoint save"].name
    assert two["checkpoint save"].host_bytes == 3_361_198_784 * 2 + 3_361_198_784 * 4 + 1_414_924_992 * 2 * 2  # full copies on each rank
    assert "measured" in one["host process baseline"].note
    cpu = _items(cosmos_ledger(cfg, "tiny", LEVERS, device_type="cpu"))["host process baseline"]
    assert "estimate" in cpu.note and "measured" not in cpu.note and cpu.host_bytes < one["host process baseline"].host_bytes


def test_selective_checkpointing_adds_the_kept_attention_outputs(tmp_path):
    text = TOML.read_text().replace('mode                = "full"', 'mode                = "selective"', 1).replace(
        'save_ops_regex      = ["fmha"]', 'save_ops_regex      = ["fmha", "flash_attention"]', 1)  # the recipe's varlen
    (tmp_path / "sel.toml").write_text(text)
    sel = cosmos_ledger(cfgmod.load(tmp_path / "sel.toml"), "edge", LEVERS, device_type="cuda")
    full = cosmos_ledger(cfgmod.load(TOML), "edge", LEVERS, device_type="cuda")
    assert sel.gpu_allocated - full.gpu_allocated == 28 * 12287 * 16 * (128 * 2 + 4)
    upstream_default = tmp_path / "fmha.toml"  # upstream's ["fmha"] names no op of the embedded trainer: nothing kept
    upstream_default.write_text(TOML.read_text().replace('mode                = "full"', 'mode                = "selective"', 1))
    assert cosmos_ledger(cfgmod.load(upstream_default), "edge", LEVERS, device_type="cuda").gpu_allocated == full.gpu_allocated


@pytest.mark.parametrize("old,new,needle", [
    ('save_ops_regex      = ["fmha"]', 'save_ops_regex      = ["fmha", "("]', "save_ops_regex '(' is not a regular expression"),
    ('save_ops_regex      = ["fmha"]', 'save_ops_regex      = [" "]', "save_ops_regex holds an empty pattern"),
    ('mode                = "full"', 'mode                = "partial"', "mode = 'partial'; use one of"),
], ids=["bad-regex", "empty-pattern", "unknown-mode"])
def test_a_save_ops_regex_that_is_not_a_regular_expression_is_one_error(tmp_path, capsys, old, new, needle):
    bad = tmp_path / "bad.toml"
    bad.write_text(TOML.read_text().replace(old, new, 1))
    assert ledgermod.main(["--toml", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_the_streamed_optimizer_state_is_priced_outside_the_activations(monkeypatch):
    """Lever 5's groups in flight live only in the optimizer step, after the activations (kept attention included)
    are freed: they add only what they exceed the activations by, and the other lines stay as they are."""
    from cosmos_framework_ext.recipe import config as cfgmod
    from cosmos_framework_ext.recipe import ledger as L

    cfg = cfgmod.from_dict({"model": {"activation_checkpointing": {"mode": "selective",
                                                                    "save_ops_regex": ["flex_attention"]}},
                            "onecard": {"attention": "flex"}})
    flags = {"COSMOS_EMA_CPU_SUBSET": True, "COSMOS_LATENT_CACHE": True}
    items = lambda led: {i.name: i for i in led.items}  # noqa: E731
    base, streamed = (L.cosmos_ledger(cfg, "edge", dict(flags, COSMOS_OPTIM_STATE_OFFLOAD=on), cap=12288)
                      for on in (False, True))
    tensors = items(base)["AdamW state"].gpu_bytes - 1414924992 * 2 * 2
    assert items(streamed)["AdamW state (streamed, lever)"].gpu_bytes == tensors  # the activations are larger
    assert items(streamed)["gradients"].gpu_bytes == items(base)["gradients"].gpu_bytes
    assert base.gpu_allocated - streamed.gpu_allocated == 1414924992 * 2 * 2
    # with no activations modelled, the groups in flight (0.75 GiB) beyond the kept attention outputs count
    monkeypatch.setattr(L, "ACT_FIXED", 0)
    monkeypatch.setattr(L, "ACT_PER_TOKEN_LAYER_HIDDEN", 0.0)
    tiny_acts = items(L.cosmos_ledger(cfg, "edge", dict(flags, COSMOS_OPTIM_STATE_OFFLOAD=True), cap=4096))
    kept = tiny_acts["kept attention outputs (selective AC)"].gpu_bytes
    in_flight = 3 * L.OPTIM_GROUP_BYTES
    assert 0 < kept < in_flight
    assert tiny_acts["AdamW state (streamed, lever)"].gpu_bytes == in_flight - kept + tensors


def test_what_closes_the_gap_names_only_what_is_not_on(tmp_path):
    """The advice never asks for a lever that is already on, counts the latent cache among the levers, and asks for
    more checkpointed layers first when the recipe leaves some out."""
    from cosmos_framework_ext.recipe import config as cfgmod
    from cosmos_framework_ext.recipe.ledger import cosmos_ledger, what_closes_the_gap
    from patches.core.runtime import GiB

    twelve = cfgmod.load(REPO / "toml" / "vision_sft_edge_12gb.toml")
    flags = {"COSMOS_EMA_CPU_SUBSET": True, "COSMOS_VAE_CPU_OFFLOAD": True}
    advice = what_closes_the_gap(twelve, "edge", flags, int(11.0 * GiB))
    assert "COSMOS_LATENT_CACHE=1 COSMOS_OPTIM_STATE_OFFLOAD=1" in advice and "EMA_CPU_SUBSET" not in advice, advice
    every = dict(flags, COSMOS_LATENT_CACHE=True, COSMOS_OPTIM_STATE_OFFLOAD=True)
    assert "set COSMOS" not in what_closes_the_gap(twelve, "edge", every, int(11.0 * GiB))  # only the cap is left
    cfg = cfgmod.load(REPO / "toml" / "vision_sft_edge_24gb.toml")
    cfg.onecard.checkpoint_layers = 20
    budget = cosmos_ledger(cfg, "edge", every, checkpoint_layers=24).gpu_reserved
    advice = what_closes_the_gap(cfg, "edge", every, budget)
    assert advice.startswith("to fit: raise [onecard] checkpoint_layers from 20 to 24"), advice


def test_the_ledger_command_reads_the_card_cap_as_its_budget(monkeypatch, capsys):
    from cosmos_framework_ext.recipe import ledger

    monkeypatch.delenv("BUDGET_GIB", raising=False)
    monkeypatch.setenv("ONECARD_GPU_MEMORY_GIB", "11")
    ledger.main(["--toml", str(REPO / "toml" / "vision_sft_edge_12gb.toml")])
    assert "budget 11.00 GiB" in capsys.readouterr().out
    monkeypatch.setenv("BUDGET_GIB", "15")  # BUDGET_GIB first, as before
    ledger.main(["--toml", str(REPO / "toml" / "vision_sft_edge_12gb.toml")])
    assert "budget 15.00 GiB" in capsys.readouterr().out


def test_every_attention_setting_names_an_op_the_selective_policy_keeps():
    """The ledger prices kept attention outputs by ``[onecard] attention``'s op: every setting has one, and the
    recipes' attention regexes (``ATTENTION_OPS``) match it, so the ledger and the policy agree on what is kept."""
    import re

    from cosmos_framework_ext.levers.selective_ac import ATTENTION_OPS
    from cosmos_framework_ext.recipe.attention import ATTENTION_IMPLS
    from cosmos_framework_ext.recipe.ledger import ATTENTION_OP_NAMES

    assert set(ATTENTION_OP_NAMES) == set(ATTENTION_IMPLS)
    for impl, op in ATTENTION_OP_NAMES.items():
        assert any(re.search(p, op) for p in ATTENTION_OPS), impl
