"""Frozen lookup tables on the host (``[onecard] host_embeddings = true``): the text-token embedding
``embed_tokens`` (a lookup, no arithmetic) and ``lm_head`` (which the diffusion forward never runs) stay in host
memory; only the looked-up rows reach the GPU.

For the edge preset the two tables are 2 x 131,072 x 2,048 parameters: 1.0 GiB in bf16 that a 12 GB card needs for
activations. A row lookup copies values and does no arithmetic, so the rows that reach the GPU are the table's own
bytes wherever the lookup runs: the forward, the gradients and the checkpoint are those of the resident model
(``tests/equivalence/test_host_embeddings.py``: bitwise, with the tables' values changed by a resume after the lever
is attached).

How: the two modules' parameters are moved to the host in place (the same ``Parameter`` objects, so the
checkpoint's ``net.embed_tokens.weight``/``net.lm_head.weight``, a resume's ``copy_`` and the EMA see them as
before). ``embed_tokens.forward`` looks the ids up on the host and sends the rows to the compute device from pinned
memory without a synchronize; the trainer builds the ids on the host for it
(:func:`cosmos_framework_ext.recipe.attention.build_packed_inputs`'s ``ids_device``). Ids already on the GPU are
read back first (correct, but that waits for the GPU). ``lm_head`` on the host fails loudly if anything calls it.

Exactness needs both tables frozen (their gradients would be host tensors) and one unsharded rank (FSDP2 would
shard and move them): :func:`check_host_embeddings` refuses the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from patches.core.device import to_device

__all__ = ["HOST_MODULES", "HostTables", "check_host_embeddings", "park_lookup_tables"]

HOST_MODULES = ("embed_tokens", "lm_head")
"""The submodules of ``Cosmos3OmniTransformer`` kept on the host."""


def check_host_embeddings(on: bool, trainable: list[str], world_size: int, mixed: bool) -> None:
    """Refuse ``host_embeddings`` where it could not be exact.

    Args:
        on: ``[onecard] host_embeddings``.
        trainable: the trainable parameter names (``keys_to_select``'s match).
        world_size: ranks.
        mixed: parameters stored in another dtype than they compute in (FSDP2's ``MixedPrecisionPolicy``).

    Raises:
        ValueError: a table that trains, more than one rank, or FSDP2 mixed precision (the message names the fix).
    """
    if not on:
        return
    trains = [n for n in trainable if n.split(".")[0] in HOST_MODULES]
    if trains:
        raise ValueError(f"[onecard] host_embeddings keeps frozen lookup tables on the host, but {trains[0]} trains "
                         "([optimizer] keys_to_select matches it): drop it from keys_to_select or set host_embeddings = false")
    if world_size > 1 or mixed:
        raise ValueError("[onecard] host_embeddings runs on one rank with the parameters stored in the compute dtype "
                         f"({'world size ' + str(world_size) if world_size > 1 else 'fsdp_master_dtype differs'}; "
                         "FSDP2 would shard the tables): set host_embeddings = false")


@dataclasses.dataclass
class HostTables:
    """What :func:`park_lookup_tables` moved: ``names`` (parameter names) and ``host_bytes`` (bytes now on the host,
    not on the GPU)."""

    names: list[str]
    host_bytes: int


def park_lookup_tables(model: torch.nn.Module, device: torch.device) -> HostTables:
    """Move ``model.embed_tokens`` and ``model.lm_head`` to the host in place and make ``embed_tokens`` look up there
    and return its rows on ``device`` (non-blocking, from pinned memory).

    Raises:
        ValueError: ``model`` has neither table, or a table's parameter requires grad.
    """
    names, nbytes = [], 0
    for mod_name in HOST_MODULES:
        mod = getattr(model, mod_name, None)
        if mod is None:
            continue
        for pname, p in mod.named_parameters():
            if p.requires_grad:
                raise ValueError(f"{mod_name}.{pname} requires grad: only frozen tables can stay on the host")
            p.data = p.data.to("cpu")  # same Parameter object: state dicts, copy_ and the EMA still find it
            names.append(f"{mod_name}.{pname}")
            nbytes += p.numel() * p.element_size()
    if not names:
        raise ValueError(f"{type(model).__name__} has none of {HOST_MODULES}")
    emb = getattr(model, "embed_tokens", None)
    if emb is not None:
        lookup = emb.forward

        def forward(ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return to_device(lookup(ids.to("cpu"), *args, **kwargs), device)  # the rows, without a synchronize

        emb.forward = forward
    return HostTables(names, nbytes)
