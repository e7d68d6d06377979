"""The frozen lookup tables on the host (``[onecard] host_embeddings``) train exactly what the resident model trains.

:func:`cosmos_framework_ext.levers.host_embeddings.park_lookup_tables` moves ``embed_tokens`` and ``lm_head`` to the
host in place; ``embed_tokens`` looks up there and sends the rows to the compute device.

- **Exact, CPU:** the tiny preset (fp32) with the tables parked, then loaded from a different state (what a resume
  does after the lever is attached): every loss and gradient of two optimizer steps ``torch.equal`` those of the
  resident model loaded from the same state (the anchor: the model as built, no lever).
- **Exact, GPU:** the same with the model on the GPU and the tables on the host; the tables' bytes are off the card.
- **Where:** both tables are host tensors, the same ``Parameter`` objects, and ``lm_head`` fails loudly if run.

Planted: a lever that looks up in a copy taken when it was attached (a resume's values never reach the lookup)
breaks the equality.
"""

from __future__ import annotations

import pytest
import torch

from cosmos_framework_ext.levers import host_embeddings as he
from tests.equivalence import tiny_recipe as R
from tests.test_train import env  # noqa: F401 - the fixture (dataset, output root, no checkpoint paths)


def _other_state(model) -> dict:
    """A state of the same model with every tensor changed (what a checkpoint written later holds)."""
    g = torch.Generator().manual_seed(7)
    return {k: (v + torch.randn(v.shape, generator=g).to(v.device, v.dtype) * 0.01) if v.is_floating_point() else v
            for k, v in model.state_dict().items()}


def _run(model, steps: int = 2):
    """Two optimizer steps of the recipe (2 micro-batches each); the losses and the gradients of each step."""
    opt = R.make_optimizer(model)
    out = []
    for it in range(steps):
        opt.zero_grad(set_to_none=True)
        losses = []
        for micro in range(R.GRAD_ACCUM):
            loss = R.loss_of(model, R.micro_batch(it, micro))
            loss.backward()
            losses.append(loss.detach().cpu())
        out.append((losses, [p.grad.detach().cpu().clone() for p in model.parameters() if p.requires_grad]))
        opt.step()
    return out


def _same(a, b) -> bool:
    return all(len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))
               and len(ga) == len(gb) > 0 and all(torch.equal(x, y) for x, y in zip(ga, gb))
               for (la, ga), (lb, gb) in zip(a, b))


def _pair(device: str, park=he.park_lookup_tables):
    resident, _ = R.make_model(device=device)
    parked, _ = R.make_model(device=device)
    tables = park(parked, torch.device(device))
    state = _other_state(resident)
    resident.load_state_dict(state)
    parked.load_state_dict(state)  # after the lever: copy_ into the host tensors
    return resident, parked, tables


def test_parked_tables_train_the_same_cpu():
    resident, parked, tables = _pair("cpu")
    assert tables.names == ["embed_tokens.weight", "lm_head.weight"]
    assert tables.host_bytes == sum(p.numel() * 4 for n, p in parked.named_parameters() if n in tables.names)
    assert _same(_run(resident), _run(parked))


def test_planted_a_lookup_in_a_copy_taken_at_attach_breaks_it():
    def stale(model, device):  # the bug: the lookup reads a snapshot, not the parameter a resume writes into
        table = model.embed_tokens.weight.detach().clone()
        model.embed_tokens.forward = lambda ids: torch.nn.functional.embedding(ids.to("cpu"), table).to(device)
        return he.HostTables(["embed_tokens.weight"], table.numel() * table.element_size())

    resident, parked, _ = _pair("cpu", park=stale)
    assert not _same(_run(resident), _run(parked))


def test_refusals():
    he.check_host_embeddings(False, ["embed_tokens.weight"], 8, True)  # off: nothing checked
    he.check_host_embeddings(True, ["layers.0.mlp_moe_gen.up_proj.weight"], 1, False)
    with pytest.raises(ValueError, match="embed_tokens.weight trains"):
        he.check_host_embeddings(True, ["embed_tokens.weight"], 1, False)
    with pytest.raises(ValueError, match="lm_head.weight trains"):
        he.check_host_embeddings(True, ["lm_head.weight"], 1, False)
    with pytest.raises(ValueError, match="world size 2"):
        he.check_host_embeddings(True, [], 2, False)
    with pytest.raises(ValueError, match="fsdp_master_dtype differs"):
        he.check_host_embeddings(True, [], 1, True)
    model, _ = R.make_model()
    model.embed_tokens.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="requires grad"):
        he.park_lookup_tables(model, torch.device("cpu"))
    with pytest.raises(ValueError, match="has none of"):
        he.park_lookup_tables(torch.nn.Linear(2, 2), torch.device("cpu"))


def test_the_trainer_parks_the_tables_and_refuses_a_trainable_one(env):  # noqa: F811
    from cosmos_framework_ext.recipe import train
    from patches.core.errors import UserError
    from tests.test_train import small_toml

    def recipe(**edits):
        path = small_toml(env, **edits)
        path.write_text(path.read_text().replace("[onecard]\n", "[onecard]\nhost_embeddings = true\n", 1))
        return train.CosmosSFT(train.parse_args(["--sft-toml", str(path)]))

    r = recipe()
    r.preflight()
    r._build_model()
    assert r.host_tables.names == ["embed_tokens.weight", "lm_head.weight"]
    text = [i.name for i in r.ledger.items]
    assert "weights (lookup tables on the host, lever)" not in text  # a CPU run: nothing moves off a card
    bad = recipe(**{'keys_to_select = [': 'keys_to_select = ["embed_tokens", ',
                    "detach_text_stream = true": "detach_text_stream = false"})  # only this lever's check refuses it
    with pytest.raises(UserError, match="host_embeddings keeps frozen lookup tables.*embed_tokens.weight trains"):
        bad.preflight()


def test_the_ledger_moves_the_tables_to_the_host_column():
    from cosmos_framework_ext.recipe import config as cfgmod
    from cosmos_framework_ext.recipe.ledger import cosmos_ledger

    on = cfgmod.from_dict({"onecard": {"host_embeddings": True}})
    off = cfgmod.from_dict({})
    a, b = cosmos_ledger(off, "edge", {}, cap=12288), cosmos_ledger(on, "edge", {}, cap=12288)
    tables = 2 * 131072 * 2048 * 2
    assert a.gpu_allocated - b.gpu_allocated == tables
    wb = next(i for i in b.items if i.name.startswith("weights"))
    assert wb.host_bytes == tables and not wb.pinned
    # refused where the trainer refuses it (DRYRUN prices no run the trainer would not start), on a CPU not moved
    with pytest.raises(ValueError, match="world size 2"):
        cosmos_ledger(on, "edge", {}, world_size=2, cap=12288)
    head = cfgmod.from_dict({"onecard": {"host_embeddings": True},
                             "model": {"parallelism": {"fsdp_master_dtype": "float32"}}})
    with pytest.raises(ValueError, match="fsdp_master_dtype differs"):
        cosmos_ledger(head, "edge", {}, cap=12288)
    assert cosmos_ledger(on, "edge", {}, device_type="cpu", cap=12288).gpu_allocated == cosmos_ledger(
        off, "edge", {}, device_type="cpu", cap=12288).gpu_allocated


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
def test_cuda_parked_tables_train_the_same():
    resident, parked, tables = _pair("cuda")
    assert all(dict(parked.named_parameters())[n].device.type == "cpu" for n in tables.names)
    assert _same(_run(resident), _run(parked))
    with pytest.raises(RuntimeError):
        parked.lm_head(torch.zeros(1, parked.config.hidden_size, device="cuda"))
