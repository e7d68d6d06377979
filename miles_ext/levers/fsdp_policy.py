"""FSDP2 for MiniMax-H3 + LoRA as the miles-diffusion recipe applies it, plus what a 1-GPU run adds.

Upstream ``apply_fsdp2`` (radixark/miles_diffusion's code): one
``MixedPrecisionPolicy(param_dtype=--diffusion-forward-dtype, reduce_dtype=--fsdp-reduce-dtype)`` shared by
every wrap; ``fully_shard`` per ``model._no_split_modules`` block (H3: ``MiniMaxH3TransformerBlock``,
``MiniMaxH3TokenRefinerBlock``, ``MiniMaxH3AdaLayerNormOut``), then at the root; ``CPUOffloadPolicy`` under
``--fsdp-cpu-offload``. The master dtype is the dtype the base is *stored* in (``--fsdp-master-dtype``).

**LoRA adapters get their own FSDP units.** What FSDP2 (torch 2.13, ``FSDPParamGroup._init_mp_dtypes``)
actually requires is a uniform original dtype (and reduce dtype) among the *trainable* parameters of a unit;
frozen parameters may differ, and a mixed-dtype all-gather is done through a uint8 view. So a block unit holding
a frozen bf16 base and trainable fp32 adapters is accepted, while one holding trainable bf16 *and* fp32 params
raises ``AssertionError: FSDP expects uniform original parameter dtype`` (both checked in
``tests/equivalence/test_h3_fsdp_policy.py``). We still put each block's adapters (its ``lora_A`` /
``lora_B`` linears) into one unit of their own, wrapped before the block, so that:

- no unit ever mixes a bf16 base with fp32 adapters (robust to torch versions that check all parameters);
- the block units hold no trainable parameter, so they never reduce-scatter, and the adapter units
  reduce-scatter only the fp32 adapter gradients;
- the adapters' policy can differ from the base's (``adapter_param_dtype``). Its default is the base's
  ``param_dtype``, which is upstream's single shared policy: adapters are *computed* in bf16, stored and
  updated in fp32.

Own adapter units need one more thing: each block gathers its adapter unit when its own forward starts
(:func:`_gather_with_block`), because PEFT reads ``lora_A.weight.dtype`` before FSDP's hook on ``lora_A`` runs.

**Two dtype nuances** (upstream doc §1): ``param_dtype`` applies to every parameter of a unit, so the
``_keep_in_fp32_modules`` (``proj_in``, ``time_embedder``, ``proj_out``, ...) are *stored* fp32 but gathered in
the forward at ``param_dtype``. Hence for a frozen base an fp32 and a bf16 master gather bit-identical bf16
weights: an fp32 master stores w and gathers bf16(w); a bf16 master stores bf16(w) and gathers it unchanged;
the keep-fp32 modules are fp32 under both. "fp32 buys nothing"
(``tests/equivalence/test_h3_fsdp_policy_master_dtype.py``).
With CPU offload, FSDP2 adds each micro-batch's reduced gradient into the host gradient (``+=``), so gradient
accumulation works unchanged (checked bitwise in ``test_h3_fsdp_policy.py``). ``cast_forward_inputs`` defaults to ``False`` as in upstream's newest code: the
H3 forward casts its inputs itself, and FSDP's cast would turn the fp64 rotary ``position_ids`` into bf16.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from patches.core import torch_internals

__all__ = [
    "MASTER_DTYPES",
    "parse_master_dtype",
    "keep_in_fp32_names",
    "set_master_dtype",
    "apply_fsdp2",
    "clip_offloaded_grad_norm",
    "prefetched_adapter_units",
]

MASTER_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``--fsdp-master-dtype`` values and the storage dtype each selects."""


def parse_master_dtype(value: str | torch.dtype) -> torch.dtype:
    """``"fp32"`` / ``"bf16"`` (or the torch dtype) -> the torch dtype; ``ValueError`` otherwise."""
    if isinstance(value, torch.dtype):
        if value in MASTER_DTYPES.values():
            return value
    elif value in MASTER_DTYPES:
        return MASTER_DTYPES[value]
    raise ValueError(
        f"--fsdp-master-dtype must be one of {sorted(MASTER_DTYPES)} (fp32 or bf16), got {value!r}; "
        "fp16 or other dtypes would change the weights the forward gathers"
    )


def _is_lora(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def keep_in_fp32_names(model: nn.Module) -> set[str]:
    """Parameter and buffer names of ``model`` that belong to its ``_keep_in_fp32_modules``.

    Matched as diffusers matches them when it loads a checkpoint with ``torch_dtype``
    (``model_loading_utils.load_model_dict_into_meta``): an entry must equal one ``.``-component of the name.
    """
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    return {n for n in names if any(k in n.split(".") for k in keep)}


def set_master_dtype(model: nn.Module, master_dtype: str | torch.dtype) -> nn.Module:
    """Store ``model``'s base in ``master_dtype``, in place, as ``from_pretrained(torch_dtype=...)`` would.

    Every floating parameter and buffer is cast, except the ``_keep_in_fp32_modules`` (kept fp32) and the LoRA
    adapters (``*.lora_A.*`` / ``*.lora_B.*``, left as they are: fp32 after :func:`miles_ext.levers.lora.attach_lora`).
    Call it before :func:`apply_fsdp2`. Raises ``ValueError`` for a dtype outside fp32/bf16.
    """
    dtype = parse_master_dtype(master_dtype)
    keep = keep_in_fp32_names(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point() or _is_lora(name):
                continue
            want = torch.float32 if name in keep else dtype
            if p.dtype != want:
                p.data = p.data.to(want)
        for mod_name, mod in model.named_modules():
            for b_name, b in list(mod.named_buffers(recurse=False)):
                full = f"{mod_name}.{b_name}" if mod_name else b_name
                if b.is_floating_point():
                    want = torch.float32 if full in keep else dtype
                    if b.dtype != want:
                        mod._buffers[b_name] = b.to(want)
    return model


def _adapter_linears(block: nn.Module) -> list[nn.Module]:
    """The ``lora_A[*]`` / ``lora_B[*]`` linears under ``block``, in module order."""
    out: list[nn.Module] = []
    for module in block.modules():
        for attr in ("lora_A", "lora_B"):
            sub = getattr(module, attr, None)
            if isinstance(sub, nn.ModuleDict):
                out.extend(sub.values())
    return out


def _gather_with_block(block: nn.Module, adapter_unit: nn.Module) -> None:
    """Gather ``adapter_unit`` (an ``FSDPModule``) whenever ``block``'s forward starts.

    PEFT's LoRA layer casts its input to ``lora_A.weight.dtype`` *before* it calls ``lora_A``, i.e. before the
    adapter unit's own pre-forward hook has swapped in the gathered weight: it reads the sharded fp32 parameter,
    casts the input to fp32, and the gathered bf16 weight then fails (``expected m1 and m2 to have the same
    dtype``; torch 2.13, PEFT 0.21). Gathering the unit together with the block (``FSDPModule.unshard``, which
    waits) makes PEFT read the gathered dtype, as it does upstream where the adapters sit in the block's unit.
    The unit's own hooks then find it gathered, reshard it after its last linear ran, and regather it for
    backward as usual.
    """

    def pre_forward(module: nn.Module, args: tuple) -> None:
        adapter_unit.unshard()  # type: ignore[operator]

    block.register_forward_pre_hook(pre_forward)


def apply_fsdp2(
    model: nn.Module,
    *,
    cpu_offload: bool,
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype | None = torch.float32,
    mesh=None,
    master_dtype: str | torch.dtype | None = None,
    adapter_param_dtype: torch.dtype | None = None,
    pin_memory: bool | None = None,
    cast_forward_inputs: bool = False,
    reshard_after_forward: bool = True,
    resident: Iterable[int] | None = None,
    adapters_on_device: bool = False,
    exact_pin: bool = False,
    prefetch: int = 1,
    no_split_modules: Iterable[str] | None = None,
    h2d_prefetch: bool | None = None,
    prefetch_adapters: bool = True,
) -> nn.Module:
    """Shard ``model`` with FSDP2, in place: adapter units, then one unit per ``_no_split_modules`` block, then
    the root. Returns ``model``. A process group must be initialised (``mesh=None`` uses the default one).

    Args:
        cpu_offload: ``CPUOffloadPolicy``: sharded parameters, gradients and optimizer state live on the host
            (``--fsdp-cpu-offload``); the forward gathers to the compute device.
        param_dtype: dtype parameters are gathered in for compute (upstream ``--diffusion-forward-dtype``,
            default bf16); ``None`` computes in the stored dtype.
        reduce_dtype: gradient reduce-scatter dtype (``--fsdp-reduce-dtype``, default fp32).
        mesh: a 1-D ``DeviceMesh`` to shard over (``None``: FSDP2's default, the world on CUDA when it is
            available; pass ``init_device_mesh("cpu", (world,))`` to compute on the CPU on a GPU machine).
        master_dtype: if given, :func:`set_master_dtype` first (``"fp32"`` / ``"bf16"``); ``ValueError`` otherwise.
        adapter_param_dtype: compute dtype of the LoRA adapter units; ``None`` -> ``param_dtype`` (upstream).
        pin_memory: pin the offloaded host memory; ``None`` -> pin only when computing on CUDA (the mesh's device
            type, or CUDA when it is available and ``mesh`` is ``None``; a CPU run must not pin).
        cast_forward_inputs: FSDP's forward-input cast (off: H3 casts its own inputs; see module docstring).
        reshard_after_forward: free gathered parameters after each unit's forward (ZeRO-3 behaviour).
        resident: partial residency (:mod:`miles_ext.levers.residency`) under ``cpu_offload``: indices into the
            ``_no_split_modules`` blocks (module order) that stay on the device; the other blocks are offloaded and
            streamed, with ``prefetch`` blocks gathered ahead in forward; the root unit stays on the device.
            ``None``: every unit offloaded (plain ``--fsdp-cpu-offload``).
        adapters_on_device: under ``cpu_offload``, the LoRA adapter units are not offloaded: adapters, their
            gradients and (built after this) their AdamW state live on the compute device, as in an all-resident run.
        exact_pin: offloaded shards go into one exact-size page-locked arena (:mod:`miles_ext.levers.pinned`) instead of
            the caching host allocator's power-of-two blocks; the report is ``model._onecard_pinned_report``.
        prefetch: offloaded blocks gathered ahead of the running block in forward (with ``resident``).
        no_split_modules: class names of the blocks to wrap (default: ``model._no_split_modules``; upstream passes
            its ``parallel_plan.no_split_modules``).
        h2d_prefetch: under ``cpu_offload``, each eligible offloaded unit gets a
            :class:`miles_ext.levers.h2d_prefetch.H2DPrefetch`, so its host-to-device copies run on a side stream one block
            ahead (FSDP2 at one rank copies on the compute stream at use; values are bit-identical either way).
            ``None`` (default): with ``resident`` only, where it was measured faster; ``True``: also under full
            offload (every block then prefetches the next), where it was measured slower
            (``docs/levers/h2d-prefetch.md``); ``False``: never. Ineligible units (a CPU mesh, world size > 1) are left as they are; the report is
            ``model._onecard_h2d_prefetch``.
        prefetch_adapters: with the explicit prefetch, each block's offloaded LoRA adapter unit is prefetched just
            before its block (:func:`miles_ext.levers.residency.wire_prefetch`'s ``companions``) instead of gathered
            when the block starts, where its copy would wait on the one side stream behind the next block's. ``False``
            is the earlier behaviour (the same-run baseline of the change; values identical either way).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if master_dtype is not None:
        set_master_dtype(model, master_dtype)
    if pin_memory is None:
        device_type = mesh.device_type if mesh is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        pin_memory = device_type == "cuda"
    offload = CPUOffloadPolicy(pin_memory=pin_memory and not exact_pin) if cpu_offload else None
    base_mp = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=cast_forward_inputs
    )
    adapter_mp = MixedPrecisionPolicy(
        param_dtype=adapter_param_dtype if adapter_param_dtype is not None else param_dtype,
        reduce_dtype=reduce_dtype,
        cast_forward_inputs=cast_forward_inputs,
    )
    common = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    on_device = dict(common)
    if offload is not None:
        common["offload_policy"] = offload

    wrap_names = set(no_split_modules if no_split_modules is not None else
                     (getattr(model, "_no_split_modules", None) or ()))
    if not wrap_names:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules; nothing to wrap per block")
    blocks = [m for m in model.modules() if type(m).__name__ in wrap_names]
    adapters_outside = {id(m) for m in _adapter_linears(model)} - {id(m) for b in blocks for m in _adapter_linears(b)}
    torch_internals.require()  # every FSDP2 internal the levers below touch, checked once, before any change
    if adapters_outside:
        raise ValueError("LoRA adapters outside the _no_split_modules blocks: their own units would be unordered; "
                         "target only modules inside the blocks")
    keep = None if resident is None or offload is None else {int(i) for i in resident}
    if keep is not None and not keep <= set(range(len(blocks))):
        raise ValueError(f"resident block indices {sorted(keep - set(range(len(blocks))))} out of range: the model "
                         f"has {len(blocks)} blocks")
    adapter_kw = on_device if adapters_on_device else common
    for i, block in enumerate(blocks):
        adapters = _adapter_linears(block)
        if adapters:
            fully_shard(adapters, mp_policy=adapter_mp, **adapter_kw)
            _gather_with_block(block, adapters[0])
        fully_shard(block, mp_policy=base_mp, **(on_device if keep is not None and i in keep else common))
    fully_shard(model, mp_policy=base_mp, **(on_device if keep is not None else common))
    prefetch_h2d = offload is not None and (h2d_prefetch or (h2d_prefetch is None and keep is not None))
    if keep is not None or prefetch_h2d:
        from miles_ext.levers.residency import wire_prefetch

        # offloaded adapter units are prefetched with their block (just before it), not gathered when it starts
        companions = ({i: _adapter_linears(b)[:1] for i, b in enumerate(blocks)}
                      if prefetch_adapters and offload is not None and not adapters_on_device else None)
        wire_prefetch(blocks, [i for i in range(len(blocks)) if keep is None or i not in keep], depth=prefetch,
                      companions=companions)
    if exact_pin and offload is not None:
        from miles_ext.levers.pinned import pin_offloaded_shards

        model._onecard_pinned_report = pin_offloaded_shards(model, pin=pin_memory)
    if prefetch_h2d:
        from miles_ext.levers.h2d_prefetch import attach

        model._onecard_h2d_prefetch = attach(model)
    return model


def prefetched_adapter_units(model: nn.Module) -> int:
    """How many LoRA adapter units some block's explicit forward prefetch gathers (``apply_fsdp2``'s
    ``prefetch_adapters``): a report for benchmarks; 0 without the explicit prefetch."""
    adapters = {id(a[0]._get_fsdp_state()) for m in model.modules() if (a := _adapter_linears(m))
                and hasattr(a[0], "_get_fsdp_state") and m is not model}
    seen = set()
    for m in model.modules():
        state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
        for target in getattr(state, "_states_to_forward_prefetch", None) or ():
            if id(target) in adapters:
                seen.add(id(target))
    return len(seen)


@torch.no_grad()
def clip_offloaded_grad_norm(
    parameters: Iterable[torch.Tensor], max_norm: float, *, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for FSDP2 gradients that may live on the host (CPU offload).

    The total norm is taken over the *global* gradients: each sharded (``DTensor``) gradient contributes the
    ``norm_type``-power sum of its local shard, summed over the mesh dimensions it is sharded on (replicated
    dimensions are not summed twice); plain tensors contribute as they are. The reduction runs on the device the
    gradients live on, so offloaded gradients are reduced by the process group's CPU backend (gloo, as upstream's
    ``cpu:gloo,cuda:nccl`` group does) instead of NCCL, where ``clip_grad_norm_`` on host DTensors would fail.
    Scaling is torch's: ``g *= min(1, max_norm / (total + 1e-6))``.

    Returns the total norm (fp32 scalar tensor on the gradients' device). Raises ``RuntimeError`` if it is
    non-finite and ``error_if_nonfinite``.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    inf = norm_type == float("inf")
    # one partial per set of process groups to reduce over: (groups, sum of |g|^p or max |g|)
    partials: dict[tuple[int, ...], tuple[tuple, torch.Tensor]] = {}
    locals_: list[torch.Tensor] = []
    for g in grads:
        if isinstance(g, DTensor):
            local = g.to_local()
            groups = tuple(g.device_mesh.get_group(i) for i, pl in enumerate(g.placements) if isinstance(pl, Shard))
        else:
            local, groups = g, ()
        locals_.append(local)
        v = local.detach().float()
        part = v.abs().amax() if inf else v.norm(norm_type) ** norm_type
        key = tuple(id(x) for x in groups)
        if key in partials:
            _, prev = partials[key]
            part = part.to(prev.device)
            partials[key] = (groups, torch.maximum(prev, part) if inf else prev + part)
        else:
            partials[key] = (groups, part)
    device = locals_[0].device
    total: torch.Tensor | None = None
    for groups, part in partials.values():
        for group in groups:
            dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
        part = part.to(device)
        total = part if total is None else (torch.maximum(total, part) if inf else total + part)
    assert total is not None
    total_norm = total if inf else total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({total_norm.item()})")
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for local in locals_:
        local.mul_(coef.to(local.device, local.dtype))
    return total_norm
