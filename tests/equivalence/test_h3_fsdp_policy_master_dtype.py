"""``miles_ext.levers.fsdp_policy``'s master dtype: a bf16 master trains what an fp32 master trains (frozen H3 base,
LoRA-only, FSDP2 with CPU offload).

The 8-GPU recipe stores the base in fp32 (``--fsdp-master-dtype fp32``); the 1-GPU port stores it in bf16,
halving the host bytes of the offloaded base. Both gather the base at ``param_dtype`` bf16 for the forward
(``--diffusion-forward-dtype``), and the ``_keep_in_fp32_modules`` stay fp32 under both, so the forward sees
bit-identical weights: bf16(w) for a weight stored fp32 and the same bf16(w) stored bf16. The adapters are
fp32 under both (PEFT autocast) and initialised identically (:func:`miles_ext.levers.lora.attach_lora` replays the
fp32 init on a bf16 base).

Claims, one spawned rank (gloo), tiny H3, LoRA rank 8, AdamW, the recipe's 8-pair step (8 micro-batches):
step-1 loss identical (``==``); LoRA adapters fp32 with ``requires_grad`` under both; stored dtypes as stated;
and, stronger than the loss, LoRA gradients of step 1 and LoRA weights after 2 steps ``torch.equal``. No
tolerance: both runs execute the same operations on the same values.

Planted bugs that must break the proof: bf16 adapters (``autocast_adapter_dtype=False``, upstream's
``load_lora_adapter`` path on a bf16 base), and plain PEFT ``get_peft_model`` on the bf16 base, whose adapters
are fp32 but initialised from bf16-rounded draws -- it passes "loss identical and adapters fp32" (lora_B starts
at zero, so step 1 cannot see it) and is caught only by the weights.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from miles_ext.recipe.schedule import pair_schedule
from patches.core.runtime import free_port
from tests.equivalence.h3_ranks import cpu_mesh, launch

SEED, STEPS = 1234, 2
RUNS = ("fp32", "bf16", "bug_bf16_adapters", "bug_plain_peft_init")


def _model(kind: str) -> torch.nn.Module:
    from miles_ext.levers.fsdp_policy import set_master_dtype
    from miles_ext.recipe.presets import H3_LORA_TARGETS
    from miles_ext.recipe.presets import build_transformer
    from tests.equivalence.h3_tiny_run import make_lora_model

    if kind in ("fp32", "bf16"):
        return make_lora_model(master_dtype=kind)
    if kind == "bug_bf16_adapters":
        return make_lora_model(master_dtype="bf16", autocast_adapter_dtype=False)
    # bug_plain_peft_init: what get_peft_model alone does on a bf16 base (same RNG as make_lora_model)
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = build_transformer("tiny")
    set_master_dtype(model, "bf16")
    torch.manual_seed(1)
    get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=list(H3_LORA_TARGETS),
                                     init_lora_weights="gaussian"))
    return model


def _run(kind: str) -> dict[str, Any]:
    from miles_ext.levers.fsdp_policy import apply_fsdp2
    from miles_ext.levers.lora import lora_parameters
    from miles_ext.recipe.sft import train_step
    from tests.equivalence.h3_tiny_run import OPTIM, synthetic_pairs

    model = _model(kind)
    stored = {n: p.dtype for n, p in model.named_parameters()}
    base_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not p.requires_grad)
    apply_fsdp2(model, cpu_offload=True, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, mesh=cpu_mesh())
    lora = lora_parameters(model)
    adapters = {n: (p.dtype, p.requires_grad, p.device.type) for n, p in lora.items()}
    opt = torch.optim.AdamW(list(lora.values()), **OPTIM)
    pairs = synthetic_pairs(32)
    grads: dict[str, torch.Tensor] = {}

    def snapshot_grads() -> None:
        if not grads:
            grads.update({n: p.grad.full_tensor().clone() for n, p in lora.items()})

    losses = [
        train_step(model, opt, slots, pairs, seed=SEED, max_grad_norm=1.0, after_backward=snapshot_grads)
        for slots in pair_schedule(8, 8, 4, 1)[:STEPS]
    ]
    weights = {n: p.full_tensor().detach().clone() for n, p in lora.items()}
    return dict(stored=stored, base_bytes=base_bytes, adapters=adapters, losses=losses, grads=grads, weights=weights,
                keep=sorted(getattr(model, "_keep_in_fp32_modules")))


def _worker(rank: int, world: int, out: str) -> None:
    torch.save({k: _run(k) for k in RUNS}, out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("h3_master") / "runs.pt"
    launch(_worker, 1, str(out))
    return torch.load(out)


def proof_holds(ref: dict[str, Any], got: dict[str, Any]) -> bool:
    """The claim: step-1 loss identical, adapters fp32 + trainable, step-1 grads and final weights equal."""
    return (
        got["losses"][0] == ref["losses"][0]
        and all(d == torch.float32 and rg for d, rg, _ in got["adapters"].values())
        and ref["grads"].keys() == got["grads"].keys()
        and all(torch.equal(ref["grads"][k], got["grads"][k]) for k in ref["grads"])
        and all(torch.equal(ref["weights"][k], got["weights"][k]) for k in ref["weights"])
    )


def test_bf16_master_trains_what_fp32_master_trains(runs):
    ref, got = runs["fp32"], runs["bf16"]
    assert got["losses"][0] == ref["losses"][0]  # step-1 loss identical
    assert got["losses"] == ref["losses"]
    for run in (ref, got):
        assert len(run["adapters"]) == 36
        assert all(d == torch.float32 and rg and dev == "cpu" for d, rg, dev in run["adapters"].values())
    assert proof_holds(ref, got)


def test_stored_dtypes(runs):
    """fp32 master: everything fp32. bf16 master: the frozen base bf16 except the _keep_in_fp32_modules
    (proj_in, audio_proj_in, time_embedder, proj_out, audio_proj_out; rope has only a buffer), adapters fp32."""
    ref, got = runs["fp32"], runs["bf16"]
    assert set(ref["stored"].values()) == {torch.float32}
    keep = set(got["keep"])
    for name, dtype in got["stored"].items():
        if ".lora_A." in name or ".lora_B." in name or any(k in name.split(".") for k in keep):
            assert dtype == torch.float32, name
        else:
            assert dtype == torch.bfloat16, name
    assert any(n.startswith("proj_out.") for n in got["stored"]) and got["stored"]["proj_out.weight"] == torch.float32
    assert got["base_bytes"] < 0.6 * ref["base_bytes"]  # the point of the lever: about half the host bytes


@pytest.mark.parametrize("bug", ["bug_bf16_adapters", "bug_plain_peft_init"])
def test_planted_bug_breaks_the_proof(runs, bug):
    assert not proof_holds(runs["fp32"], runs[bug])


def test_plain_peft_init_passes_the_weak_checks_only(runs):
    """Why the proof compares weights: plain PEFT on a bf16 base gives fp32, trainable adapters and the same
    step-1 loss, yet trains from a different (bf16-rounded) lora_A."""
    ref, bug = runs["fp32"], runs["bug_plain_peft_init"]
    assert bug["losses"][0] == ref["losses"][0]
    assert all(d == torch.float32 and rg for d, rg, _ in bug["adapters"].values())
    assert not all(torch.equal(ref["weights"][k], bug["weights"][k]) for k in ref["weights"])


def test_bf16_adapters_are_bf16(runs):
    assert {d for d, _, _ in runs["bug_bf16_adapters"]["adapters"].values()} == {torch.bfloat16}


# ------------------------------------------------------------------------------------------- on CUDA
def _cuda_entry(rank: int, world: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    # upstream's deterministic mode: the two runs must execute bit-identical kernels (index_add in the AdaLN
    # backward and attention's dQ otherwise use atomics)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.cuda.set_device(rank)
    # upstream's group under --fsdp-cpu-offload: host tensors (offloaded grads, the clip norm) go through gloo
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world)
    try:
        from miles_ext.levers.fsdp_policy import apply_fsdp2
        from miles_ext.levers.lora import lora_parameters
        from miles_ext.recipe.sft import draw_micro_batch, micro_batch_loss_sum, train_step
        from tests.equivalence.h3_tiny_run import OPTIM, make_lora_model, synthetic_pairs

        pairs = synthetic_pairs(32)
        res: dict[str, Any] = {}
        for kind in ("fp32", "bf16"):
            model = make_lora_model(master_dtype=kind).to("cuda")
            apply_fsdp2(model, cpu_offload=True, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            lora = lora_parameters(model)
            # gradient accumulation under offload: A then B == A + B
            acc = {}
            for name, idx in (("a", [0]), ("b", [1]), ("ab", [0, 1])):
                for i in idx:
                    noised = draw_micro_batch([pairs[i].to("cuda")], seed=3, rollout_id=0, microbatch_id=i, dp_rank=0)
                    micro_batch_loss_sum(model, noised).backward()
                acc[name] = {n: p.grad.full_tensor().clone() for n, p in lora.items()}
                model.zero_grad(set_to_none=True)
            opt = torch.optim.AdamW(list(lora.values()), **OPTIM)
            grad_dev = set()
            losses = [
                train_step(model, opt, slots, pairs, seed=SEED, max_grad_norm=1e-3, device="cuda",
                           after_backward=lambda: grad_dev.update(p.grad.to_local().device.type for p in lora.values()))
                for slots in pair_schedule(8, 8, 4, 1)[:STEPS]
            ]
            res[kind] = dict(losses=losses, acc=acc, grad_dev=grad_dev,
                             param_dev={p.to_local().device.type for p in model.parameters()},
                             pinned=all(p.to_local().is_pinned() for p in lora.values()),
                             weights={n: p.full_tensor().detach().cpu() for n, p in lora.items()})
        if rank == 0:
            torch.save(res, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
def test_on_cuda_bf16_master_offload_and_accumulation(tmp_path):
    """On a GPU, with pinned host offload and upstream's cpu:gloo,cuda:nccl group: bf16 master == fp32 master
    (losses and LoRA weights after 2 steps, bitwise), grads and params on the pinned host, accumulation adds,
    and the clip (active: max norm 1e-3) runs on the host gradients."""
    out = str(tmp_path / "cuda.pt")
    world = min(torch.cuda.device_count(), 2)
    torch.multiprocessing.spawn(_cuda_entry, args=(world, free_port(), out), nprocs=world, join=True)
    res = torch.load(out)
    ref, got = res["fp32"], res["bf16"]
    assert got["losses"] == ref["losses"]
    assert all(torch.equal(ref["weights"][k], got["weights"][k]) for k in ref["weights"])
    for run in (ref, got):
        assert run["grad_dev"] == {"cpu"} and run["param_dev"] == {"cpu"} and run["pinned"]
        a, b, ab = run["acc"]["a"], run["acc"]["b"], run["acc"]["ab"]
        assert all(torch.equal(ab[k], a[k] + b[k]) for k in a)
        assert any(float(v.abs().max()) > 0 for v in a.values())
