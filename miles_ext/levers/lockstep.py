"""Micro-batches forwarded block by block together ("lockstep"): each streamed block crosses PCIe once per group of
micro-batches in the forward and once in the backward, instead of once per micro-batch (exact).

**The fault.** Under full CPU offload every FSDP2 block unit is gathered host-to-device twice per micro-batch: in its
forward, and in its backward (where the checkpointed recompute runs). At short clips a block's compute is shorter
than its 1.29 GB copy, so a step of ``K`` micro-batches costs about ``2 K`` copies of the 66 GB base however well the
copy overlaps: 81x480x832 took 9.81 s per step of 2 with the side-stream prefetch against 6.62 s all-resident
(``docs/h3.md``).

**The lever.** :class:`Lockstep` runs the forwards of ``N`` micro-batches so that every block unit runs for micro-batch
0, 1, ..., N-1 before the next unit runs for any of them, and keeps each unit gathered until its last caller is done:

- :meth:`Lockstep.run` runs each micro-batch's forward-and-loss callable in its own thread, used as a coroutine:
  exactly one runs at any moment. A thread stops just before each block call (a forward pre-hook ahead of FSDP2's),
  and the scheduler resumes the thread whose next block call comes first (fewest block calls made so far; ties in
  micro-batch order). So each thread runs the model's own ``forward`` (every FSDP2 hook, diffusers' checkpoint)
  unchanged and in its own order; only the interleaving between micro-batches changes. Each FSDP2 unit in a block
  (the block and its adapter unit) skips its reshard-after-forward for every caller but the last of the group.
- :meth:`Lockstep.backward` runs one backward over the ``N`` losses. Each thread numbers its autograd nodes from 0
  (the sequence number autograd orders ready nodes by is thread-local), so the graphs of the micro-batches carry
  the same numbers and autograd runs them side by side, node by node: both calls' backward (and checkpointed
  recompute) of a block run before either call's post-backward, and the unit is gathered once and resharded once.

**Exactness.** Every micro-batch's forward and backward runs the same kernels on the same bytes as when it runs
alone. Left alone, autograd would sum the gradients of a parameter used by several micro-batches before accumulating
them, in the parameter's dtype (bf16 under the recipe's mixed precision, where the sequential step adds each
micro-batch's gradient into the fp32 sharded gradient on its own). So for micro-batch ``k > 0`` each trainable
parameter of a block is used, for that call, through an alias leaf of its own (same storage); after the backward its
gradient is added in micro-batch order exactly as the sequential step's FSDP2 reduce adds it (cast to the reduce dtype
and back, to the host under CPU offload, ``+=`` into the sharded gradient; without FSDP2 ``+=`` into ``.grad``). Every
gradient and weight is then bitwise the sequential step's, for any group size and dtype. The forwards must draw no
global random numbers (the H3 recipe's draws come from per-micro-batch generators and its LoRA has no dropout) and
must not call blocks from other threads.

**Memory.** The checkpointed block inputs of all ``N`` micro-batches are alive at once, and the backward recomputes
a block for all ``N`` side by side: ``N`` times the block-inputs and backward-working-set terms of the full-offload
model (:func:`miles_ext.levers.input_recompute.full_offload_terms`); the gathered and staged blocks stay as they are
(no unit is kept gathered for longer than its calls in a group); the trainable parameters' gradients of micro-batches
1 to N-1 wait on the card until the backward ends (N-1 times the adapters' gradients in their compute dtype: 0.69 GB
at rank 64 on the 33 B model in bf16).

Proof: ``tests/equivalence/test_h3_lockstep.py`` (bitwise at 2 and 3 micro-batches without FSDP, FSDP2 resident and
full offload, fp32 and bf16; each offloaded block gathered twice per group instead of twice per micro-batch;
no more units gathered at once than in the sequential step, also when one micro-batch's backward runs ahead;
every unit sharded after the step; planted: the forward's deferral missing, settings not restored after a failure,
gradients summed by autograd, losses returned out of order).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch import nn

__all__ = ["Lockstep", "lockstep_units", "parse_group"]

T = TypeVar("T")


def parse_group(value: "str | int | None", source: str) -> int:
    """A lockstep group size (``--lockstep-micro-batches``): a whole number >= 1 of micro-batches forwarded together;
    1, unset, empty or ``none`` is off (1).

    Raises:
        UserError: anything else (0, negative, fractions, words), one line naming ``source``.
    """
    from patches.core.errors import UserError
    from patches.core.flags import read_count, shown

    if value is None:
        return 1
    text = str(value).strip().lower()
    if text in ("", "none"):
        return 1
    count = read_count(text)
    if count is not None and count >= 1:
        return count
    raise UserError(f"{source} {shown(value)}: use a whole number of micro-batches >= 1 to forward block by block "
                    "together (1 or none: one micro-batch at a time)")


def lockstep_units(model: nn.Module) -> list[nn.Module]:
    """The modules ``model`` runs in lockstep: its ``_no_split_modules`` blocks (H3: the transformer, token-refiner and
    output-norm blocks, FSDP2's block units), in module order. ``ValueError`` when the model declares none."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules: no blocks to run in lockstep")
    return [m for m in model.modules() if type(m).__name__.removeprefix("FSDP") in names]


def _groups(module: nn.Module) -> list[Any]:
    """The ``FSDPParamGroup`` of every FSDP2 unit in ``module`` (itself and nested units), outermost first."""
    out = []
    for m in module.modules():
        state = getattr(m, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if callable(state) else None
        if group is not None and all(group is not g for g in out):
            out.append(group)
    return out


class _Aborted(BaseException):
    """Raised in a parked thread when another micro-batch failed: its forward stops where it is."""


class _Worker:
    __slots__ = ("k", "fn", "calls", "done", "result", "error", "abort", "go", "parked", "thread")

    def __init__(self, k: int, fn: Callable[[], Any]):
        self.k, self.fn = k, fn
        self.calls = 0
        self.done = self.abort = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.go, self.parked = threading.Event(), threading.Event()
        self.thread: threading.Thread | None = None


class Lockstep:
    """Lockstep forwards and one backward for groups of micro-batches over ``units`` (see the module docstring).

    Args:
        model: the model; its blocks (:func:`lockstep_units`) get a forward pre-hook and hook each (removed by
            :meth:`remove`). FSDP2 units must be at world size 1.
        group: micro-batches per lockstep group (>= 1; 1 leaves every step as it was).

    Raises:
        ValueError: ``group`` < 1, a model without ``_no_split_modules``, FSDP2 units over more than one rank.
        UpstreamMismatch: a torch whose FSDP2 internals differ (:mod:`patches.core.torch_internals`).

    Attributes:
        forwards: lockstep groups run; ``deferred``: reshards after forward skipped because a later caller of the
            same unit was still to come.
    """

    def __init__(self, model: nn.Module, group: int = 2):
        if group < 1:
            raise ValueError(f"a lockstep group of {group} micro-batches: use 1 or more")
        self.units, self.group = lockstep_units(model), int(group)
        self._unit_groups = {id(u): _groups(u) for u in self.units}
        if any(self._unit_groups.values()):
            from patches.core import torch_internals

            torch_internals.require()  # the FSDP2 internals below, checked before any hook is registered
        for g in (g for gs in self._unit_groups.values() for g in gs):
            pg = getattr(g, "_all_gather_process_group", None)
            if pg is not None and pg.size() != 1:
                raise ValueError("lockstep micro-batches run at world size 1 only (their gradients are added into "
                                 "the local shard as a one-rank reduce does)")
        inner = {id(g) for gs in self._unit_groups.values() for g in gs}
        # the units around the blocks (the root): every micro-batch's forward runs inside them at once
        self._outer = [g for g in _groups(model) if id(g) not in inner]
        self._local = threading.local()
        self._workers: list[_Worker] = []
        self._by_id: dict[int, Any] = {}
        self._saved_mesh: dict[int, Any] = {}
        self._grads: list[tuple[int, Any, Any, torch.Tensor]] = []  # (micro-batch, parameter, FSDPParam|None, alias)
        self._roots: list[torch.Tensor] = []  # the last run's results that require grad (made in the worker threads)
        self._swapped: dict[int, list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]] = {}
        self.forwards = 0
        self.deferred = 0
        self._hooks = [u.register_forward_pre_hook(self._pre_hook, prepend=True) for u in self.units]
        self._hooks += [u.register_forward_hook(self._post_hook) for u in self.units]

    def remove(self) -> None:
        """Remove the hooks (the units then run as before)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------------------------------------ forward
    def _pre_hook(self, module: nn.Module, args: tuple) -> None:
        w = getattr(self._local, "worker", None)
        if w is None:  # not a lockstep forward (a plain forward, or the checkpoint's recompute in the backward)
            return
        w.parked.set()
        w.go.wait()
        w.go.clear()
        if w.abort:
            raise _Aborted()
        w.calls += 1
        later = any(not o.done and o.calls < w.calls for o in self._workers if o is not w)
        for g in self._unit_groups.get(id(module), ()):
            self._by_id[id(g)] = g
            if id(g) not in self._saved_mesh:
                self._saved_mesh[id(g)] = g.post_forward_mesh_info
            # the last caller of the group reshards as the unit is configured to; the others keep it gathered
            if later and self._saved_mesh[id(g)] is not None:
                g.post_forward_mesh_info = None
                self.deferred += 1
            else:
                g.post_forward_mesh_info = self._saved_mesh[id(g)]
        if w.k:
            self._own_gradients(module, w)

    def _own_gradients(self, unit: nn.Module, w: _Worker) -> None:
        """For micro-batch ``w.k`` > 0: each trainable parameter of ``unit`` is used, for this call, through an alias
        of its own (``param.detach().requires_grad_()``: the same storage, so FSDP2's regather in the backward fills
        it too; a leaf of its own, so its gradient does not reach the parameter). Autograd then never sums two
        micro-batches' gradients of a parameter (it would, in the parameter's dtype: bf16 under mixed precision);
        :meth:`backward` adds the aliases' gradients in micro-batch order, as the sequential step does."""
        owners = {id(fp.unsharded_param): fp for g in self._unit_groups.get(id(unit), ())
                  for fp in g.fsdp_params if g.is_unsharded}
        swapped = self._swapped.setdefault(w.k, [])
        for mod in unit.modules():
            for name, param in list(mod._parameters.items()):
                if param is None or not param.requires_grad:
                    continue
                alias = nn.Parameter(param.detach(), requires_grad=True)
                self._grads.append((w.k, param, owners.get(id(param)), alias))
                mod._parameters[name] = alias  # this call only (FSDP2 swaps its parameters the same way)
                swapped.append((mod, name, param, alias))

    def _post_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        w = getattr(self._local, "worker", None)
        if w is None:
            return
        for mod, name, param, view in self._swapped.pop(w.k, ()):
            if mod._parameters.get(name) is view:  # FSDP2 may have resharded it since (then it holds its shard)
                mod._parameters[name] = param

    def _outer_post_forward(self, g: Any, orig: Callable[..., Any]) -> Callable[..., Any]:
        """``g``'s ``post_forward`` while a group runs: a micro-batch that finishes its forward while another is still
        in it leaves ``g`` gathered (the last one reshards as ``g`` is configured to)."""

        def post_forward(module: nn.Module, input: Any, output: Any) -> Any:
            w = getattr(self._local, "worker", None)
            mesh = g.post_forward_mesh_info
            if w is None or mesh is None or all(o.done for o in self._workers if o is not w):
                return orig(module, input, output)
            from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

            # as if this forward were the only one: in its forward (an earlier finisher set the group IDLE, where
            # FSDP2's reshard ignores the setting) and not resharding after it
            g.post_forward_mesh_info, g._training_state = None, TrainingState.FORWARD
            self.deferred += 1
            try:
                return orig(module, input, output)
            finally:
                g.post_forward_mesh_info = mesh
        return post_forward

    def _thread_main(self, w: _Worker, grad: bool, device: "torch.device | None", stream: Any) -> None:
        self._local.worker = w
        try:
            if device is not None:
                torch.cuda.set_device(device)
                torch.cuda.set_stream(stream)
            with torch.set_grad_enabled(grad):
                w.result = w.fn()
        except _Aborted:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            w.error = e
        finally:
            w.done = True
            self._local.worker = None
            w.parked.set()

    def _resume(self, w: _Worker) -> None:
        """Let ``w`` run until it parks before its next block call or finishes."""
        w.parked.clear()
        if w.thread is None:
            w.thread = threading.Thread(target=self._thread_main, args=(w, *self._ctx), daemon=True,
                                        name=f"onecard-lockstep-{w.k}")
            w.thread.start()
        else:
            w.go.set()
        w.parked.wait()

    def run(self, fns: Sequence[Callable[[], T]]) -> list[T]:
        """Run ``fns`` (each one micro-batch's forward and loss; at most :attr:`group`) in lockstep and return their
        results in order. The calling thread's grad mode, CUDA device and stream carry over to each; other
        thread-local state (autocast, saved-tensor hooks) must be entered inside the callable.

        Raises:
            ValueError: more callables than :attr:`group`, or a lockstep run already in progress.
            Whatever a callable raised (the first in run order); the other forwards are stopped where they were.
        """
        if len(fns) > self.group:
            raise ValueError(f"{len(fns)} micro-batches for a lockstep group of {self.group}")
        if self._workers:
            raise ValueError("a lockstep run is already in progress")
        self._restore_mesh()
        self._grads.clear()  # the aliases of a run whose backward never came
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self._ctx = (torch.is_grad_enabled(), torch.cuda.current_device() if cuda else None,
                     torch.cuda.current_stream() if cuda else None)
        workers = self._workers = [_Worker(k, fn) for k, fn in enumerate(fns)]
        for g in self._outer:
            g.post_forward = self._outer_post_forward(g, g.post_forward)  # instance attribute: this unit only
        try:
            for w in workers:  # each runs up to its first block call
                self._resume(w)
                if w.error is not None:
                    raise w.error
            while True:
                live = [w for w in workers if not w.done]
                if not live:
                    break
                w = min(live, key=lambda o: (o.calls, o.k))
                self._resume(w)
                if w.error is not None:
                    raise w.error
        finally:
            for w in workers:
                if not w.done:
                    w.abort = True
                    w.go.set()
            for w in workers:
                if w.thread is not None:
                    w.thread.join()
            self._workers = []
            for g in self._outer:
                del g.post_forward
            self._restore_mesh()
        self.forwards += 1
        results = [w.result for w in workers]
        self._roots = [r for r in results if isinstance(r, torch.Tensor) and r.requires_grad]
        return results

    def _restore_mesh(self) -> None:
        for gid, mesh in self._saved_mesh.items():
            self._by_id[gid].post_forward_mesh_info = mesh
        self._saved_mesh.clear()

    # ------------------------------------------------------------------------------------------------ backward
    def backward(self, losses: Sequence[torch.Tensor]) -> None:
        """One backward over ``losses`` (the last :meth:`run`'s results, or values computed from them).

        Nothing is deferred here: each worker thread numbers its autograd nodes from 0 (the sequence number is
        thread-local), so the micro-batches' graphs of the same structure carry the same numbers and autograd runs
        them node by node side by side; each unit's post-backward fires after both calls' backward of it, and the
        unit is resharded once. The engine is started at the run's results, whose nodes carry the workers' numbers
        (each the highest of its thread): ``losses`` computed from them on the calling thread (the recipe's
        normalisation) carry the caller's numbers, which may be lower than every node of the workers' graphs (a fresh
        caller thread, or one that made fewer nodes than a forward does), and starting there let one micro-batch's
        whole backward run before the other's began, gathering every unit once per micro-batch (seen on the H200 at
        2 x 50 blocks). So the gradients of the results are taken first (``torch.autograd.grad`` over the caller's
        nodes alone: the same nodes, the same values) and the backward then starts from the results with them.
        Each result must reach the losses only through them (a result used twice is summed by ``grad`` as the one
        backward would sum it). Should one micro-batch's backward still run ahead (a graph with more nodes before
        its blocks), the units are gathered again for the others rather than kept gathered for all of them.
        """
        try:
            losses = list(losses)
            roots, self._roots = self._roots, []
            if roots and not all(any(r is l for r in roots) for l in losses):
                grads = torch.autograd.grad(losses, roots, allow_unused=True)
                pairs = [(r, g) for r, g in zip(roots, grads) if g is not None]
                torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
            else:
                torch.autograd.backward(losses)
            self._fold()
        finally:
            self._grads.clear()

    def _fold(self) -> None:
        """The gradients taken aside in the forward, added in micro-batch order the way the sequential step adds
        them: under FSDP2 as its reduce at world size 1 does (cast to the reduce dtype, back to the parameter's dtype,
        to the host under CPU offload, ``+=`` into the sharded gradient); otherwise ``+=`` into ``.grad``."""
        for _, target, fp, alias in sorted(self._grads, key=lambda e: e[0]):  # stable: one micro-batch's calls in order
            grad = alias.grad
            if grad is None:  # this call's use of the parameter got no gradient
                continue
            if fp is None:
                if target.grad is None:
                    target.grad = grad.clone()
                else:
                    target.grad += grad
                continue
            g = grad.to(fp.reduce_dtype or grad.dtype).to(fp.orig_dtype)
            if fp.offload_to_cpu:
                g = g.to("cpu")
            sharded = fp.sharded_param
            if sharded.grad is None:
                sharded.grad = fp.to_sharded_dtensor(g.reshape(fp.sharded_size))
            else:
                sharded.grad._local_tensor += g.reshape(fp.sharded_size)
