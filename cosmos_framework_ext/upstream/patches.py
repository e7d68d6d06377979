"""The levers, adapted to a real cosmos-framework checkout (installed by ``patches/cosmos_table.py``).

Lever 1 (``COSMOS_EMA_CPU_SUBSET``). Upstream builds a second, fp32 tower ``net_ema`` (12.5 GiB for Edge)
in ``OmniMoTModel.set_up_model`` and drives it through ``DTensorFastEmaModelUpdater``
(``update_average`` / ``copy_to`` / ``cache`` / ``restore``). Here:

- the fp32 tower is never built: :class:`EmaPlaceholder` (a module with no parameters) stands in its
  place, so attribute walks (DCP's ``_get_fqns``) still resolve and nothing aliases ``net``;
  ``ema_exp_coefficient`` (gamma) is computed by upstream as usual;
- :class:`HostEmaWorker` takes the updater's place and speaks its API over an
  :class:`~cosmos_framework_ext.levers.ema.EMA` with ``placement="cpu_subset"``, created lazily from the
  parameters that require grad (the optimizer's ``keys_to_select``) at the first update or checkpoint load. Upstream's own
  ``on_before_zero_grad`` (with its beta) and ``ema_scope`` (with its reshards) run unchanged;
  ``ema_scope`` caches and swaps only the trainable local shards, on the host;
- DCP checkpoints: ``ModelWrapper.state_dict`` appends ``net_ema.<k>`` for every ``net.<k>`` (as upstream's
  distillation wrapper appends state that lives outside the module registry), and ``load_state_dict``
  routes ``net_ema.*`` to the host buffers by canonical name.

Lever 2 (``COSMOS_VAE_CPU_OFFLOAD``). ``tokenizer_vision_gen.model.model`` (the ``WanVAE_`` module, which the
trainer's ``model.to("cuda")`` never moves) and its 48-channel ``scale`` tensors are parked in pinned
host memory after ``set_up_tokenizers``; ``get_data_and_condition`` (once per micro-batch) and
``encode``/``decode`` (sampling) run inside :meth:`UpstreamVaeOffload.on_device` (the one way in, as for
:class:`~cosmos_framework_ext.levers.vae_offload.VAEOffload`, which it extends with the ``scale`` tensors).

Lever 5 (``COSMOS_OPTIM_STATE_OFFLOAD``): the optimizer ``_optimizer_cls`` builds gets
:class:`~cosmos_framework_ext.levers.optim_offload.OptimStateOffload`.

Lever 6 (``COSMOS_FROZEN_BF16``). Upstream marks the trainable subset (``keys_to_select``) when it builds the
optimizer, after ``build_net`` has wrapped ``net`` with FSDP2 in the fp32 master dtype. So the lever runs right
after ``init_optimizer_scheduler`` (before the trainer's checkpoint load and the first forward), as
:class:`~cosmos_framework_ext.levers.frozen_bf16.WrappedFrozenBF16` over ``net``: frozen parameters on the GPU
as their bf16 cast, their fp32 values on the host, ``net.state_dict()`` (DCP's ``net.*`` and the host EMA's
frozen ``net_ema.*``) unchanged.

The detached text stream (``COSMOS_DETACH_TEXT_STREAM``), the embedded trainer's ``[onecard] detach_text_stream``
(:mod:`cosmos_framework_ext.levers.text_stream`). Upstream's network scatters the frozen ``embed_tokens`` output into
a zero buffer, writes the trainable ``vae2llm`` output into the same buffer in place, and gathers the packed
sequence's text (``causal_seq``) and vision (``full_only_seq``) streams from it, so the text stream enters the decoder
layers requiring a gradient and the backward pass runs through it for nothing. ``_impl_forward`` (the decoder stack of
the three MoT text models) is handed a copy of the pack whose ``causal_seq`` is detached, while the text model's
``embed_tokens`` is frozen (read at each call). Exact: upstream's packer opens a causal split only for text
(``sequence_packing``'s ``pack_text_tokens``; vision, actions and sound close a sample's full split in
``finish_sample``), so the causal rows are ``embed_tokens`` output or the buffer's zeros, and nothing trainable writes
them.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from patches.core.flags import LATENT_CACHE, LATENT_CACHE_DIR, latent_cache_dir
from patches.core.runtime import GiB, as_dtensor, group_moves_host_tensors, to_local

from cosmos_framework_ext.levers.ema import EMA, canonical_name
from cosmos_framework_ext.levers.text_stream import detached_if_frozen
from cosmos_framework_ext.levers.vae_offload import VAEOffload
from cosmos_framework_ext.upstream.latents import UpstreamLatentCache, serving, start_decode_free, with_vae

log = logging.getLogger("onecard.upstream")


class EmaPlaceholder(nn.Module):
    """Stands where upstream's fp32 ``net_ema`` tower would be; holds nothing (the EMA lives on the host)."""

    def extra_repr(self) -> str:
        return "EMA kept in pinned host memory by onecard (COSMOS_EMA_CPU_SUBSET=1)"


class HostEmaWorker:
    """Upstream ``DTensorFastEmaModelUpdater``'s API over a CPU-subset :class:`EMA` of the trainable subset."""

    def __init__(self) -> None:
        self.ema: EMA | None = None
        self._cached: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def ensure(self, net: nn.Module) -> EMA:
        """Create the host EMA from ``net``'s trainable parameters on first use.

        Raises:
            ValueError: no parameter requires grad (``keys_to_select`` empty or matching nothing).
        """
        if self.ema is None:
            trainable = [n for n, p in net.named_parameters() if p.requires_grad]
            self.ema = EMA(net, placement="cpu_subset", trainable=trainable)
            log.info("onecard: CPU-subset EMA over %d trainable tensors, %.2f GiB pinned",
                     len(trainable), self.ema.pinned_bytes / GiB)
        return self.ema

    # -- the updater's verbs, as upstream calls them
    def update_average(self, src_model: nn.Module, tgt_model: nn.Module, beta: float = 0.9999) -> None:
        self.ensure(src_model).step(beta)

    def copy_to(self, src_model: nn.Module, tgt_model: nn.Module) -> None:
        if isinstance(src_model, EmaPlaceholder):  # ema_scope: EMA -> net, trainable shards only
            self.ensure(tgt_model).copy_to()
        # net -> EMA (set_up_model): the host EMA is created from net when first needed

    def cache(self, parameters: Any, is_cpu: bool = False) -> None:
        del is_cpu  # always on the host
        self._cached = [(p, to_local(p).detach().to("cpu", copy=True)) for p in parameters if p.requires_grad]

    def restore(self, parameters: Any) -> None:
        del parameters
        if self._cached is None:
            raise RuntimeError("restore() without cache(): ema_scope was not entered")
        with torch.no_grad():
            for p, saved in self._cached:
                to_local(p).copy_(saved)
        self._cached = None

    # -- checkpoint entries
    def net_ema_entries(self, net: nn.Module, net_keys: list[str]) -> dict[str, torch.Tensor]:
        """``{"net_ema.<k>": tensor}`` for every ``k`` of ``net_keys`` (canonical FQNs, as DCP names them).

        Trainable keys hold the EMA, frozen keys and buffers the net's values in fp32. Sharded (DTensor)
        parameters give DTensors with the same mesh, placements and *global* shape and stride, so each rank
        saves its own shard and DCP sees the same chunks as for ``net.<k>``, uneven shards included (dim 0 of 7
        on 2 ranks, or of 1 with an empty shard).
        """
        shadow = self.ensure(net).state_dict()["shadow"]  # EMA for trainable keys, net in fp32 for the rest
        state = {canonical_name(k): v for k, v in net.state_dict().items()}
        out: dict[str, torch.Tensor] = {}
        for k in net_keys:
            ref = state.get(k)
            value = shadow.get(k)
            if value is None:
                continue
            if ref is not None and hasattr(ref, "device_mesh") and ref.device_mesh.size() > 1:
                value = as_dtensor(value, ref.device_mesh, ref.placements, ref.shape, ref.stride())
            out[f"net_ema.{k}"] = value
        return out


class UpstreamVaeOffload(VAEOffload):
    """Parks upstream's Wan2.2 VAE (``tokenizer_vision_gen.model``) and its ``scale`` tensors on the host.

    A :class:`VAEOffload` of ``wan.model`` whose moves also carry ``wan.scale`` (a tuple the module does
    not register); :meth:`on_device` is the one way in, with the one depth counter of the base class.
    """

    def __init__(self, wan: Any, device: torch.device):
        self.wan = wan
        self._host_scale = tuple(t.detach().to("cpu").pin_memory() if torch.cuda.is_available() else t.detach().cpu()
                                 for t in wan.scale)
        wan.scale = self._host_scale
        super().__init__(wan.model, device)

    def _unpark(self) -> None:
        moving = self.parked
        super()._unpark()
        if moving:
            self.wan.scale = tuple(t.to(self.device, non_blocking=True) for t in self._host_scale)

    def _park(self) -> None:
        super()._park()
        self.wan.scale = self._host_scale


# ------------------------------------------------------------------------- replacement factories
def patched_set_up_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """``set_up_model`` that builds no fp32 EMA tower and installs :class:`HostEmaWorker`."""

    def set_up_model(self):
        if not self.config.ema.enabled:
            return original(self)
        real_build = self.build_net

        def build_net(*args, **kwargs):
            # The first build is net; a build once net exists is upstream's fp32 EMA tower.
            if getattr(self, "net", None) is not None:
                return EmaPlaceholder()
            return real_build(*args, **kwargs)

        self.build_net = build_net  # instance attribute: shadows the method during the original only
        try:
            result = original(self)
        finally:
            del self.build_net
        self.net_ema_worker = HostEmaWorker()
        return result

    return set_up_model


def patched_wrapper_state_dict(original: Callable[..., Any]) -> Callable[..., Any]:
    def state_dict(self):
        sd = original(self)
        worker = getattr(self.model, "net_ema_worker", None)
        if isinstance(worker, HostEmaWorker):
            sd.update(worker.net_ema_entries(self.model.net, [k[4:] for k in sd if k.startswith("net.")]))
        return sd

    return state_dict


def patched_wrapper_load_state_dict(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_state_dict(self, state_dict):
        worker = getattr(self.model, "net_ema_worker", None)
        if not isinstance(worker, HostEmaWorker):
            return original(self, state_dict)
        ema_part = {k[len("net_ema."):]: to_local(v) for k, v in state_dict.items() if k.startswith("net_ema.")}
        rest = {k: v for k, v in state_dict.items() if not k.startswith("net_ema.")}
        ema = worker.ensure(self.model.net)
        # DCP carries no update counter (upstream counts iterations itself): keep the EMA's own
        loaded = ema.load_state_dict({"num_updates": ema.num_updates, "shadow": ema_part})
        log.info("onecard: loaded %d EMA tensors into host buffers (%d net_ema entries)", loaded, len(ema_part))
        return original(self, rest)

    return load_state_dict


def patched_broadcast_tensor_leaf(original: Callable[..., Any]) -> Callable[..., Any]:
    """``cosmos_framework.checkpoint.dcp._broadcast_tensor_leaf`` that also takes the host EMA's tensors.

    On resume with ``checkpoint.dcp_load_dedup`` (upstream's default at ed8287f and 5eee9ed), ``DistributedCheckpointer
    .load`` broadcasts every tensor of the model state dict from its one reader after ``dcp.load``. With
    ``COSMOS_EMA_CPU_SUBSET`` the ``net_ema.*`` entries (:meth:`HostEmaWorker.net_ema_entries`) are fp32 host
    tensors, and a CUDA-only process group (NCCL) cannot broadcast them: ``RuntimeError: No backend type
    associated with device type cpu``. So, for a host leaf under a
    group with no host backend:

    - world size 1: nothing to do (the one rank read every leaf itself; upstream's broadcast is a copy onto itself);
    - otherwise: the leaf goes through the current CUDA device (a device copy is broadcast as upstream does it, with
      the same mesh and placements for a DTensor, then copied back), so every rank ends with the reader's values.

    Device leaves, and host leaves under a group with a host backend, go to upstream's function unchanged.
    """

    def _broadcast_tensor_leaf(value):
        dist = torch.distributed
        local = to_local(value)
        if local.device.type != "cpu" or not dist.is_initialized() or group_moves_host_tensors():
            return original(value)
        if dist.get_world_size() == 1:
            return None
        staged = local.to(torch.device("cuda", torch.cuda.current_device()))
        if hasattr(value, "device_mesh"):
            from torch.distributed.tensor import DTensor

            original(DTensor.from_local(staged, value.device_mesh, value.placements, run_check=False,
                                        shape=value.shape, stride=value.stride()))
        else:
            original(staged)
        local.copy_(staged)
        return None

    return _broadcast_tensor_leaf


def patched_set_up_tokenizers(original: Callable[..., Any]) -> Callable[..., Any]:
    def set_up_tokenizers(self):
        result = original(self)
        tok = getattr(self, "tokenizer_vision_gen", None)
        wan = getattr(tok, "model", None)
        if wan is not None and isinstance(getattr(wan, "model", None), nn.Module) and hasattr(wan, "scale"):
            device = next(wan.model.parameters()).device
            if device.type == "cpu" and torch.cuda.is_available():
                device = torch.device("cuda", torch.cuda.current_device())
            self._onecard_vae = UpstreamVaeOffload(wan, device)
            log.info("onecard: Wan2.2 VAE parked on the host (%.2f GiB pinned)", self._onecard_vae.pinned_bytes / GiB)
            if LATENT_CACHE.value():
                self._onecard_latents = UpstreamLatentCache(latent_cache_dir(), self, device)
                self._onecard_latents.store.ensure(LATENT_CACHE_DIR)
                plan = start_decode_free(self._onecard_latents)  # before upstream starts the loader's workers
                log.info("onecard: latent cache at %s (%s)", self._onecard_latents.store.root,
                         "cached clips are not decoded" if plan else "every clip is decoded")
        return result

    return set_up_tokenizers


def patched_optimizer_cls(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_optimizer_cls`` whose ``torch.optim.Adam``/``AdamW`` streams its moments (``COSMOS_OPTIM_STATE_OFFLOAD``).

    Upstream builds the optimizer here (``utils/generator/optimizer.py``, both commits); the returned object is
    upstream's own, with :class:`~cosmos_framework_ext.levers.optim_offload.OptimStateOffload` attached (its ``step``
    streams, its ``state_dict``/``load_state_dict`` are stock, so DCP's optimizer entries are unchanged).

    Raises:
        UserError: upstream built another optimizer (``fusedadam``, Muon, Dion2): their state layout is not
            AdamW's; use ``optimizer_type = "adamw"`` or unset the flag.
    """
    from cosmos_framework_ext.levers.optim_offload import OptimStateOffload

    def _optimizer_cls(params, optimizer_type, **optimizer_kwargs):
        optimizer = original(params, optimizer_type, **optimizer_kwargs)
        optimizer._onecard_state_offload = OptimStateOffload(optimizer)
        log.info("onecard: AdamW moments in a pinned host arena (%.2f GiB), %d stream groups",
                 optimizer._onecard_state_offload.arena.nbytes / GiB, len(optimizer._onecard_state_offload.groups))
        return optimizer

    return _optimizer_cls


def patched_init_optimizer_scheduler(original: Callable[..., Any]) -> Callable[..., Any]:
    """``init_optimizer_scheduler`` after which ``net``'s frozen fp32 parameters are held as their bf16 cast.

    Nothing changes where nothing is stored in another dtype than it computes in (``ed8287f``'s bf16 master, or
    the ``fsdp_master_dtype=bfloat16`` override): the lever then says so and holds nothing.

    Raises:
        UserError: the EMA is on without ``COSMOS_EMA_CPU_SUBSET=1`` (upstream's fp32 tower would average the bf16
            copies of the frozen parameters), or ``vlm_config.pretrained_weights.enabled`` (upstream's
            ``load_pretrained_model_if_needed`` writes the understanding weights into the parameters directly,
            past the host fp32 copies).
    """
    from cosmos_framework_ext.levers.frozen_bf16 import WrappedFrozenBF16, check_with_ema
    from patches.core.errors import UserError

    def init_optimizer_scheduler(self, optimizer_config, scheduler_config):
        ema_on = bool(getattr(getattr(self.config, "ema", None), "enabled", False))
        check_with_ema(True, ema_on, isinstance(getattr(self, "net_ema_worker", None), HostEmaWorker))
        pretrained = getattr(getattr(getattr(self, "vlm_config", None), "pretrained_weights", None), "enabled", False)
        if pretrained:
            raise UserError("COSMOS_FROZEN_BF16=1 with vlm_config.pretrained_weights.enabled: upstream would load the "
                            "understanding weights into the bf16 device copies, past their fp32 values; give them "
                            "in the base checkpoint (checkpoint.load_path) instead, or unset COSMOS_FROZEN_BF16")
        result = original(self, optimizer_config, scheduler_config)
        compute = getattr(self, "precision", torch.bfloat16)
        self._onecard_frozen = WrappedFrozenBF16(self.net, compute)
        if self._onecard_frozen.names:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # hand the released fp32 shards back, as upstream does after set_up_model
            log.info("onecard: %d frozen fp32 parameters held as %s on the device (%.2f GiB saved), fp32 on the "
                     "host (%.2f GiB)", len(self._onecard_frozen.names), compute,
                     self._onecard_frozen.device_bytes_saved / GiB, self._onecard_frozen.host_bytes / GiB)
        else:
            log.info("onecard: COSMOS_FROZEN_BF16=1 has nothing to do (no frozen parameter is stored in another dtype "
                     "than %s computes in)", compute)
        return result

    return init_optimizer_scheduler


def patched_get_data_and_condition(original: Callable[..., Any]) -> Callable[..., Any]:
    """``get_data_and_condition`` with the VAE on the GPU for the call (lever 2), or, with the latent cache
    (lever 4), with the batch's sample keys known to ``_encode_vision_x0_tokens`` (the VAE moves only for a miss)."""

    def get_data_and_condition(self, data_batch, *args, **kwargs):
        if getattr(self, "_onecard_latents", None) is None:
            with with_vae(self):
                return original(self, data_batch, *args, **kwargs)
        with serving(self, data_batch):
            return original(self, data_batch, *args, **kwargs)

    return get_data_and_condition


def with_vae_on_device(original: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``original`` with the parked VAE on the GPU (one move per call; nested calls move nothing)."""

    def wrapper(self, *args, **kwargs):
        with with_vae(self):
            return original(self, *args, **kwargs)

    wrapper.__name__ = getattr(original, "__name__", "wrapper")
    return wrapper


def patched_impl_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """``unified_mot._impl_forward`` handed the pack with its text stream detached while ``embed_tokens`` is frozen.

    ``pack`` is upstream's ``SequencePack`` (a dict): ``causal_seq`` [N_und, hidden] is replaced, in a shallow copy,
    by the same values detached (:func:`~cosmos_framework_ext.levers.text_stream.detached_if_frozen`); the caller's
    pack and every other key are left as they are. A stream that needs no gradient (inference, ``no_grad``) passes
    through unchanged.
    """

    def wrapper(self, pack, *args, **kwargs):
        causal = pack.get("causal_seq")
        if isinstance(causal, torch.Tensor) and causal.requires_grad:
            # looked up at each call: FSDP2 and lever 6 replace the Parameter objects after the model is built
            detached = detached_if_frozen(causal, self.embed_tokens.weight)
            if detached is not causal:
                pack = {**pack, "causal_seq": detached}
        return original(self, pack, *args, **kwargs)

    wrapper.__name__ = getattr(original, "__name__", "wrapper")
    return wrapper
