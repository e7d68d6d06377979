"""Low-RAM, fast init of the H3 transformer: no full-model intermediate copy in any dtype.

Building ``MiniMaxH3Transformer3DModel`` for real on the host draws 33 B parameters one after the other from the
global CPU generator, then FSDP2 copies every offloaded shard into its host storage (and the exact arena once more):
two copies of the model at the moment of the copy, and minutes of serial random draws. Here:

1. :func:`meta_model`: the model is built with its *parameters* on the meta device (accelerate's
   ``init_empty_weights(include_buffers=False)``: the non-persistent ``rope.inv_freq`` buffer is computed for real,
   as the constructor computes it); nothing of the weights is allocated.
2. :func:`attach_lora_materialised`: PEFT adapters attached on the meta base, then given real CPU storage and the
   values :func:`miles_ext.levers.lora.attach_lora` gives a real model from the same global RNG state (PEFT's init replayed on
   :func:`miles_ext.levers.lora._shadow`, the zero-storage fp32 stand-in ``attach_lora`` already uses for bf16 bases).
3. :func:`miles_ext.levers.fsdp_policy.apply_fsdp2` on that model: the offloaded units get their exact pinned arena
   (``exact_pin``; :func:`miles_ext.levers.pinned.rebind_shard` accepts meta shards, the arena's pages are not touched yet),
   the others stay meta.
4. :func:`materialise`: every shard still on the meta device gets its final storage (the unit's compute device for a
   resident unit, the host for an offloaded one), then every base parameter is written straight into its shard
   from ``source``, one tensor at a time:

   - :class:`RandomInit`: the constructor's initialisers (``nn.Linear``: ``kaiming_uniform_(a=sqrt(5))`` weight and
     ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` bias; ``RMSNorm`` / ``LayerNorm``: ones, zeros), each parameter drawn from
     its own generator seeded ``stable_hash("h3-init", seed, name)`` (``name``: the diffusers parameter name) on
     ``draw_device``. The values are a function of (seed, name, draw device type) only: independent of the order of
     materialisation, of threads, of placement (resident / streamed / arena) and of the rank count (a shard is cut
     from the full parameter drawn on ``draw_device``). They are **not** the values of the global-RNG
     constructor init (same initialisers, other random streams); ``tests/equivalence/test_h3_init.py`` proves
     equality with a reference that runs the same generators on a fully built model. CPU draws run in a thread pool
     (the generators are independent), a CUDA ``draw_device`` draws on the GPU and copies into the arena (H2D-speed).
   - :class:`CheckpointInit`: a diffusers-layout safetensors checkpoint (``BASE_CHECKPOINT_PATH``: a folder with
     ``diffusion_pytorch_model.safetensors`` or ``diffusion_pytorch_model.safetensors.index.json`` + shards, or a
     pipeline folder with them under ``transformer/``), read with safetensors' ``safe_open`` one tensor at a time
     (only this rank's rows, ``get_slice``; the file is opened per tensor so its memory map never holds more than one
     tensor's pages) and cast into the storage dtype as ``from_pretrained(torch_dtype=...)`` casts it (the
     ``_keep_in_fp32_modules`` fp32). Bitwise equal to diffusers' ``from_pretrained`` of the same checkpoint (test).

Host memory during init: the arena (exactly the offloaded bytes, the steady state) plus one parameter's temporary
at a time per worker (none for a CPU random draw into a whole shard), so the host peak stays within a few percent of
the steady RSS (``tests/equivalence/test_h3_init.py`` checks it on a mid-size preset, where build-then-copy fails).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from patches.core import torch_internals
from patches.core.errors import UserError

__all__ = ["meta_model", "attach_lora_materialised", "RandomInit", "CheckpointInit", "materialise",
           "diffusers_name", "InitReport", "build_lora_fsdp", "FastBuild"]

WEIGHTS = "diffusion_pytorch_model.safetensors"
"""diffusers' single-file weights name; ``<WEIGHTS>.index.json`` is the sharded index."""


def meta_model(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` (a model constructor, e.g. the recipe's transformer) run with every parameter on the meta device
    (fp32 meta tensors, no storage) and its buffers real on the CPU (accelerate's ``init_empty_weights``)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return build()


def attach_lora_materialised(model: nn.Module, **lora_kwargs: Any) -> nn.Module:
    """:func:`miles_ext.levers.lora.attach_lora` on a meta-device base, the adapters then given CPU storage and the values
    ``attach_lora`` gives a real model from the same global RNG state (fp32 adapters; ``lora_kwargs`` as
    ``attach_lora``: ``target_modules`` (required), ``rank``, ``alpha``, ``init_lora_weights``). Advances the global RNG as
    ``attach_lora`` does.

    Raises:
        ValueError: as :func:`~miles_ext.levers.lora.attach_lora` (no target matched, rank < 1).
    """
    from peft import get_peft_model

    from miles_ext.levers.lora import _lora_config, _shadow, attach_lora, lora_parameters, matched_target_modules

    targets = list(lora_kwargs["target_modules"])
    names = matched_target_modules(model, targets)
    before = torch.get_rng_state()
    attach_lora(model, **lora_kwargs)  # meta base: PEFT draws on the CPU, then moves the adapters to meta
    after = torch.get_rng_state()
    for module in model.modules():
        for attr in ("lora_A", "lora_B"):
            sub = getattr(module, attr, None)
            if isinstance(sub, nn.ModuleDict):
                for lin in sub.values():
                    lin.to_empty(device="cpu")
    real = lora_parameters(model)
    torch.set_rng_state(before)
    shadow = _shadow(model, names)
    get_peft_model(shadow, _lora_config(lora_kwargs.get("rank", 64), lora_kwargs.get("alpha", 128), targets,
                                        lora_kwargs.get("init_lora_weights", "gaussian")))
    torch.set_rng_state(after)
    with torch.no_grad():
        for name, value in lora_parameters(shadow).items():
            real[name].copy_(value)
    for p in real.values():
        p.requires_grad_(True)
    return model


def diffusers_name(name: str) -> str:
    """A parameter name of the LoRA-wrapped model as diffusers' checkpoint names it (``.base_layer`` removed)."""
    return name.replace(".base_layer.", ".")


# ------------------------------------------------------------------------------------------------ sources
@dataclasses.dataclass(frozen=True)
class RandomInit:
    """Random init seeded per parameter (see the module docstring); ``draw_device``: where values are drawn
    (``None``: CUDA when available, else the CPU; the values depend on its type)."""

    seed: int
    """Run seed (``--seed``)."""
    draw_device: str | None = None
    """``"cpu"``, ``"cuda"`` or ``None`` (CUDA when available)."""

    def device(self) -> torch.device:
        """The draw device."""
        if self.draw_device is not None:
            return torch.device(self.draw_device)
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def generator(self, name: str, device: torch.device) -> torch.Generator:
        """The generator of parameter ``name`` (diffusers name)."""
        from patches.core.runtime import stable_hash

        return torch.Generator(device).manual_seed(stable_hash("h3-init", self.seed, name))

    def fill(self, name: str, owner: nn.Module, attr: str, out: torch.Tensor, generator: torch.Generator) -> None:
        """Draw parameter ``attr`` of ``owner`` (full shape ``out``) into ``out`` with ``generator``, as the
        owner's constructor initialises it.

        Raises:
            ValueError: no initialiser is known for this module type / parameter (named).
        """
        with torch.no_grad():
            if isinstance(owner, nn.Linear) and attr == "weight":
                nn.init.kaiming_uniform_(out, a=math.sqrt(5), generator=generator)
            elif isinstance(owner, nn.Linear) and attr == "bias":
                fan_in = owner.in_features
                bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
                nn.init.uniform_(out, -bound, bound, generator=generator)
            elif isinstance(owner, (nn.RMSNorm, nn.LayerNorm)) and attr in ("weight", "bias"):
                out.fill_(1.0 if attr == "weight" else 0.0)
            else:
                raise ValueError(f"{name}: no seeded initialiser for {type(owner).__name__}.{attr}; add one to "
                                 "miles_ext.levers.fast_init.RandomInit.fill or load a checkpoint")

    def describe(self) -> str:
        """One line for logs."""
        return f"random init (seed {self.seed}, drawn per parameter on {self.device().type})"


def _resolve_weights(path: Path) -> Path:
    for folder in (path, path / "transformer"):
        if (folder / (WEIGHTS + ".index.json")).is_file() or (folder / WEIGHTS).is_file():
            return folder
    raise UserError(f"BASE_CHECKPOINT_PATH {path}: no {WEIGHTS} or {WEIGHTS}.index.json in it or in its transformer/ "
                    "folder: point it at a diffusers MiniMaxH3Transformer3DModel checkpoint")


class CheckpointInit:
    """A diffusers-layout safetensors checkpoint, read one tensor at a time (see the module docstring).

    Args:
        path: ``BASE_CHECKPOINT_PATH`` (the model folder or a pipeline folder with ``transformer/``).

    Raises:
        UserError: no weights file, an unreadable index or a shard it names missing (each message names the file).
    """

    def __init__(self, path: str | Path):
        self.folder = _resolve_weights(Path(path))
        index = self.folder / (WEIGHTS + ".index.json")
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise UserError(f"{index}: not a safetensors index ({e}): re-save the checkpoint") from None
            self.files = {k: self.folder / v for k, v in weight_map.items()}
        else:
            from safetensors import safe_open

            with safe_open(str(self.folder / WEIGHTS), framework="pt") as f:
                self.files = {k: self.folder / WEIGHTS for k in f.keys()}
        missing = sorted({str(p) for p in self.files.values() if not p.is_file()})
        if missing:
            raise UserError(f"BASE_CHECKPOINT_PATH: shard(s) {missing[:3]} named by the index are missing")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, read from the headers (no tensor data)."""
        from safetensors import safe_open

        out: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.files.values())):
            with safe_open(str(file), framework="pt") as f:
                for k in f.keys():
                    out[k] = tuple(f.get_slice(k).get_shape())
        return out

    def check(self, model: nn.Module) -> None:
        """The checkpoint against ``model`` (meta is fine): every base parameter present with its shape, no tensor
        the model lacks, and ``config.json`` (when present) equal to the model's config.

        Raises:
            UserError: the first mismatch class, naming up to three entries and the fix.
        """
        want = {diffusers_name(n): tuple(p.shape) for n, p in model.named_parameters()
                if ".lora_A." not in n and ".lora_B." not in n}
        have = self.shapes()
        cfg_file = self.folder / "config.json"
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if cfg_file.is_file() and hasattr(base, "config"):
            saved = json.loads(cfg_file.read_text())
            diff = {k: (saved[k], base.config[k]) for k in base.config
                    if not k.startswith("_") and k in saved and _norm(saved[k]) != _norm(base.config[k])}
            if diff:
                raise UserError(f"BASE_CHECKPOINT_PATH {self.folder}: config.json differs from the preset "
                                f"(checkpoint, preset): {dict(list(diff.items())[:3])}: use the matching --preset")
        missing = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        wrong = sorted(k for k in set(want) & set(have) if want[k] != have[k])
        for what, keys in (("lacks", missing), ("has tensors the model does not have", extra),
                           ("has other shapes for", wrong)):
            if keys:
                raise UserError(f"BASE_CHECKPOINT_PATH {self.folder} {what} {len(keys)} parameter(s), e.g. {keys[:3]}: "
                                "point it at a MiniMaxH3Transformer3DModel checkpoint of this preset")

    def read_rows(self, name: str, start: int, length: int) -> torch.Tensor:
        """Rows ``[start, start + length)`` (dim 0) of tensor ``name``, in its stored dtype, on the CPU; the file is
        opened for this tensor only."""
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as f:
            sl = f.get_slice(name)
            if len(sl.get_shape()) == 0:
                return f.get_tensor(name)
            return sl[start:start + length]

    def describe(self) -> str:
        """One line for logs."""
        return f"safetensors checkpoint {self.folder} ({len(set(self.files.values()))} file(s))"


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, (list, tuple)) else v


# -------------------------------------------------------------------------------------------- materialise
@dataclasses.dataclass(frozen=True)
class InitReport:
    """What :func:`materialise` did."""

    source: str
    """:meth:`RandomInit.describe` / :meth:`CheckpointInit.describe`."""
    tensors: int
    """Base parameters written."""
    bytes: int
    """Bytes written into their storage (this rank's shards)."""
    seconds: float
    """Wall time of allocation + fill."""


def _shard_rows(fp: Any) -> tuple[tuple[int, ...], int, int]:
    """(full shape, first row, rows) of ``fp``'s shard (FSDP2 shards dim 0 as ``torch.chunk`` does)."""
    full = tuple(fp._orig_size)
    local = fp.sharded_param._local_tensor
    if not full:
        return full, 0, 0
    world, rank = fp.mesh_info.shard_mesh_size, fp.mesh_info.shard_mesh_rank
    chunk = -(-full[0] // world)
    return full, min(rank * chunk, full[0]), local.shape[0] if local.dim() else 0


def _fill_one(source, name: str, owner: nn.Module, attr: str, fp: Any) -> int:
    local = fp.sharded_param._local_tensor
    full, start, rows = _shard_rows(fp)
    whole = tuple(local.shape) == full
    with torch.no_grad():
        if isinstance(source, CheckpointInit):
            local.copy_(source.read_rows(name, start, rows) if full else source.read_rows(name, 0, 0))
        else:
            device = source.device()
            gen = source.generator(name, device)
            if whole and local.device.type == device.type:
                source.fill(name, owner, attr, local, gen)
            else:
                tmp = torch.empty(full, dtype=local.dtype, device=device)
                source.fill(name, owner, attr, tmp, gen)
                local.copy_(tmp[start:start + rows] if full else tmp)
    return local.numel() * local.element_size()


def materialise(model: nn.Module, source: RandomInit | CheckpointInit, *, threads: int | None = None,
                order: Sequence[str] | None = None) -> InitReport:
    """Give every meta shard of the FSDP2-sharded ``model`` its final storage and write its base parameters from
    ``source`` (module docstring). LoRA adapters (already real) are left as they are.

    Args:
        model: after :func:`miles_ext.levers.fsdp_policy.apply_fsdp2` on a :func:`meta_model` model.
        source: :class:`RandomInit` or :class:`CheckpointInit` (checked against the model first).
        threads: workers filling tensors at once (``None``: ``torch.get_num_threads()`` for CPU draws and reads,
            1 for CUDA draws).
        order: diffusers names in the order to fill (tests: any order gives the same values); default module order.

    Returns:
        An :class:`InitReport`. Every parameter object of the model is new: build the optimizer after this.

    Raises:
        UserError: the checkpoint does not match the model (:meth:`CheckpointInit.check`).
        ValueError: a parameter with no seeded initialiser (:meth:`RandomInit.fill`).
    """
    from miles_ext.levers.pinned import fsdp_params, rebind_shard

    torch_internals.require()
    t0 = time.perf_counter()
    if isinstance(source, CheckpointInit):
        source.check(model)
    fps = fsdp_params(model)
    for fp in fps:
        if fp._sharded_param_data.is_meta:
            data = fp._sharded_param_data
            where = torch.device("cpu") if fp.offload_to_cpu else fp.device
            rebind_shard(fp, torch.empty(data.numel(), dtype=data.dtype, device=where), copy=False)
    names = {id(p): n for n, p in model.named_parameters()}
    modules = dict(model.named_modules())
    jobs = {}
    for fp in fps:
        name = names[id(fp.sharded_param)]
        if ".lora_A." in name or ".lora_B." in name:
            continue
        owner_name, _, attr = name.rpartition(".")
        jobs[diffusers_name(name)] = (modules[owner_name], attr, fp)
    stray = [n for n, p in model.named_parameters() if p.is_meta]
    if stray:
        raise ValueError(f"parameters outside every FSDP2 unit are still on the meta device: {stray[:3]}")
    keys = list(order) if order is not None else list(jobs)
    if sorted(keys) != sorted(jobs):
        raise ValueError("order must name every base parameter once")
    cuda_draw = isinstance(source, RandomInit) and source.device().type == "cuda"
    workers = threads if threads is not None else (1 if cuda_draw else max(1, torch.get_num_threads()))
    if workers == 1:
        written = [_fill_one(source, k, *jobs[k]) for k in keys]
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            written = list(pool.map(lambda k: _fill_one(source, k, *jobs[k]), keys))
    if cuda_draw:
        torch.cuda.synchronize()
    return InitReport(source=source.describe(), tensors=len(keys), bytes=sum(written),
                      seconds=time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------ the whole order
@dataclasses.dataclass
class FastBuild:
    """What :func:`build_lora_fsdp` built, and how long each part took."""

    model: nn.Module
    """The FSDP2-sharded LoRA model, every base shard materialised (buffers still on the CPU: a caller running it
    all-resident on a GPU moves the model, as ``model.to(device)``)."""
    report: InitReport
    """:func:`materialise`'s report (source, tensors, bytes, seconds)."""
    resident: list[int] | None
    """What ``plan_resident`` returned (indices of the resident FSDP blocks; ``None``: none planned)."""
    build_s: float
    """Wall seconds of the meta build + LoRA + master dtype + residency plan + FSDP2 sharding (+ arena allocation)."""
    materialise_s: float
    """Wall seconds of :func:`materialise` (storage + every base tensor written)."""
    meta_params_before_sharding: int
    """Base parameters on the meta device when FSDP2 sharding began (= ``report.tensors`` on this path: no base
    weight had storage before :func:`materialise` gave it its final one)."""


def build_lora_fsdp(build: Callable[[], nn.Module], *, seed: int, lora: dict[str, Any], master_dtype: str | torch.dtype, cpu_offload: bool,
                    source: "RandomInit | CheckpointInit | None" = None, plan_resident=None, mesh=None,
                    param_dtype: torch.dtype | None = torch.bfloat16, h2d_prefetch: bool | None = None,
                    prefetch_adapters: bool = True) -> FastBuild:
    """The low-RAM init order the trainer and ``benchmarks/h3_1gpu.py`` share: :func:`meta_model` of ``build`` ->
    ``torch.manual_seed(seed)`` (the LoRA init's draws) -> :func:`attach_lora_materialised` -> gradient checkpointing,
    train mode -> :func:`miles_ext.levers.fsdp_policy.set_master_dtype` (the stored dtypes the residency plan counts) ->
    ``plan_resident(model)`` -> :func:`miles_ext.levers.fsdp_policy.apply_fsdp2` (``exact_pin=True``, ``resident``,
    ``adapters_on_device=resident is not None``) -> :func:`materialise` from ``source``.

    Args:
        build: the model constructor (the recipe's: ``lambda: build_transformer(preset, device="cpu")``).
        seed: run seed: the LoRA init (global RNG) and, when ``source`` is ``None``, ``RandomInit(seed)``.
        lora: keyword arguments of :func:`miles_ext.levers.lora.attach_lora` (``target_modules``, ``rank``, ``alpha``).
        master_dtype: stored dtype of the base (``"fp32"`` / ``"bf16"`` or the torch dtype).
        cpu_offload: ``--fsdp-cpu-offload`` (offloaded shards in the exact pinned arena).
        source: :class:`RandomInit` / :class:`CheckpointInit`; ``None``: ``RandomInit(seed)``.
        plan_resident: ``callable(model) -> list[int] | None`` run on the meta model after the master dtype is set
            (e.g. :func:`miles_ext.levers.residency.plan_resident_blocks` + ``select_resident``); ``None``: no partial residency.
        mesh: ``apply_fsdp2``'s mesh (``None``: the default process group's).
        param_dtype: ``apply_fsdp2``'s compute dtype (``None``: the stored dtype).
        h2d_prefetch: ``apply_fsdp2``'s side-stream host-to-device prefetch (:mod:`miles_ext.levers.h2d_prefetch`).
        prefetch_adapters: ``apply_fsdp2``'s adapter units prefetched with their blocks (``False``: the earlier order).

    Returns:
        A :class:`FastBuild`. Build the optimizer from ``model`` afterwards (materialise makes new parameter objects).

    Raises:
        UserError: the LoRA arguments match nothing / rank < 1 (from ``attach_lora``'s ``ValueError``), the
            checkpoint does not match the model.
        ValueError: a bad ``master_dtype``; a parameter with no seeded initialiser.
    """
    from miles_ext.levers import fsdp_policy

    t0 = time.perf_counter()
    model = meta_model(build)
    torch.manual_seed(seed)  # the LoRA init's draws (the base draws from its own per-parameter generators)
    try:
        attach_lora_materialised(model, **lora)
    except ValueError as e:
        raise UserError(str(e)) from None
    model.enable_gradient_checkpointing()
    model.train()
    fsdp_policy.set_master_dtype(model, master_dtype)
    resident = plan_resident(model) if plan_resident is not None else None
    meta = sum(1 for n, p in model.named_parameters() if p.is_meta and ".lora_A." not in n and ".lora_B." not in n)
    fsdp_policy.apply_fsdp2(model, cpu_offload=cpu_offload, master_dtype=master_dtype, param_dtype=param_dtype,
                            mesh=mesh, exact_pin=True,  # offloaded shards in one exact-size pinned arena
                            resident=resident, adapters_on_device=resident is not None, h2d_prefetch=h2d_prefetch,
                            prefetch_adapters=prefetch_adapters)
    t1 = time.perf_counter()
    report = materialise(model, source if source is not None else RandomInit(seed))
    return FastBuild(model=model, report=report, resident=resident, build_s=t1 - t0,
                     materialise_s=time.perf_counter() - t1, meta_params_before_sharding=meta)
