"""Translate a miles-diffusion N-GPU recipe to M GPUs (typically 8 -> 1) without changing what it trains.

``python -m miles_ext.recipe.translate --from-gpus 8 --to-gpus 1 [--out FILE] <recipe args...>``

Reads the N-GPU argument set (upstream flag names; flags it does not know pass through unchanged, in order)
and prints the M-GPU set on the first line of stdout, then one ``# changed`` line per changed flag and one
``# invariant`` line per invariant saying why it holds. ``--out FILE`` also writes the argument line to FILE.
A translation that would break an invariant, or that holds a number the onecard trainer would refuse (its meanings,
:mod:`miles_ext.recipe.meanings`, for every flag read here, ``--lr`` and ``--clip-grad`` included), is refused: exit
status 2, one ``error:`` line on stderr naming the problem and the fix, nothing on stdout, no file written.

What changes, and only that: the GPU count (``--actor-num-gpus-per-node M --actor-num-nodes 1``), the run
name (``onecard-<M>gpu-`` prefix on ``--run-name`` / ``--wandb-run-name`` when present), ``--fsdp-cpu-offload``
(added), ``--fsdp-master-dtype bf16``, ``--global-batch-size`` pinned when the source left it to default to
its dp size (the only world-size term in upstream's derivation), and ``--onecard-emulate-dp-size N``, which
tells onecard's trainer to draw the N-GPU run's noise (the seed identity contains ``dp_rank``; see
:func:`pair_schedule`).

The batch semantics it keeps are :mod:`miles_ext.recipe.schedule`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

from miles_ext.recipe import meanings as mn
from miles_ext.recipe.schedule import check_schedule, derive_batch
from patches.core.config import ConfigError, Meaning, check_meaning
from patches.core.errors import UserError, ascii_number, cli
from patches.core.io import atomic_write_text

__all__ = ["TranslationError", "Translation", "translate", "main"]


class TranslationError(UserError):
    """A translation that would break an invariant (the CLI prints it as one ``error:`` line, exit 2)."""


_VALUE_FLAGS = (
    "--rollout-batch-size",
    "--n-samples-per-prompt",
    "--num-steps-per-rollout",
    "--global-batch-size",
    "--micro-batch-size",
    "--actor-num-gpus-per-node",
    "--actor-num-nodes",
    "--fsdp-master-dtype",
    "--fsdp-reduce-dtype",
    "--diffusion-forward-dtype",
    "--lora-rank",
    "--lora-alpha",
    "--train-dp-split-mode",
    "--diffusion-train-dp-split",
    "--seed",
    "--onecard-emulate-dp-size",
)
_BOOL_FLAGS = ("--fsdp-cpu-offload", "--use-lora", "--train-only")
_CHECKED_PASS_FLAGS = ("--lr", "--clip-grad")
"""Flags that pass through unchanged, token for token, but whose values are checked as the trainer checks its own."""

_INT_MEANINGS: dict[str, Meaning] = {
    "--rollout-batch-size": mn.COUNT, "--n-samples-per-prompt": mn.COUNT, "--num-steps-per-rollout": mn.COUNT,
    "--global-batch-size": mn.COUNT, "--micro-batch-size": mn.COUNT, "--actor-num-gpus-per-node": mn.GPU_COUNT,
    "--actor-num-nodes": mn.NODE_COUNT, "--lora-rank": mn.LORA_RANK, "--seed": mn.SEED,
    "--onecard-emulate-dp-size": mn.GPU_COUNT,
}
"""The whole-number flags the translator reads, with what they may be (the trainer's own meanings,
:mod:`miles_ext.recipe.meanings`)."""
_FLOAT_MEANINGS: dict[str, Meaning] = {"--lora-alpha": mn.LORA_ALPHA, "--lr": mn.LR, "--clip-grad": mn.CLIP_GRAD}
"""The real-number flags the translator reads, with what they may be."""
RUN_NAME_FLAGS: tuple[str, ...] = ("--run-name", "--wandb-run-name")
"""Flags treated as the run name (prefixed ``onecard-<M>gpu-``). Guessed: upstream's run-name flag name is not
in our sources, so both spellings are handled."""
_ALL_VALUE_FLAGS = _VALUE_FLAGS + RUN_NAME_FLAGS


def _scan(args: Sequence[str]) -> tuple[list[list[str]], dict[str, str], set[str]]:
    """Split ``args`` into items (a known flag with its value, or one pass-through token) and read the known
    flags (last occurrence wins, as upstream's ``--extra-args`` rule)."""
    items: list[list[str]] = []
    values: dict[str, str] = {}
    present: set[str] = set()
    i = 0
    while i < len(args):
        tok = args[i]
        name, eq, val = tok.partition("=")
        if name in _ALL_VALUE_FLAGS:
            if not eq:
                if i + 1 >= len(args):
                    raise TranslationError(f"{name} needs a value; give one or drop the flag")
                val = args[i + 1]
                i += 1
            items.append([name, val])
            values[name] = val
            present.add(name)
        elif name in _CHECKED_PASS_FLAGS:  # read, and kept as written (``--lr=1e-4`` stays one token)
            if eq:
                items.append([tok])
            else:
                if i + 1 >= len(args):
                    raise TranslationError(f"{name} needs a value; give one or drop the flag")
                val = args[i + 1]
                items += [[tok], [val]]
                i += 1
            values[name] = val
            present.add(name)
        elif tok in _BOOL_FLAGS:
            items.append([tok])
            present.add(tok)
        else:
            items.append([tok])
        i += 1
    return items, values, present


_READ = {int: ascii_number(int), float: ascii_number(float)}
"""The project's number readers (ASCII only, no spaces or underscores, integers within 64 bits)."""


def _number(flag: str, text: str, kind: type) -> Any:
    """``text`` of ``flag`` read by :data:`_READ` (``kind`` ``int`` or ``float``); :class:`TranslationError` (one
    line) if it is not such a number."""
    try:
        return _READ[kind](text)
    except argparse.ArgumentTypeError as e:
        raise TranslationError(f"{flag}: {e}; fix the value") from None


def _int(values: dict[str, str], flag: str, default: int | None) -> int | None:
    """``flag``'s value as a whole number checked by its meaning (:data:`_INT_MEANINGS`), or ``default`` when absent."""
    if flag not in values:
        return default
    value = _number(flag, values[flag], int)
    _check_flag(value, flag)
    return value


def _float(values: dict[str, str], flag: str) -> float | None:
    """``flag``'s value as a number checked by its meaning (:data:`_FLOAT_MEANINGS`), or ``None`` when absent."""
    if flag not in values:
        return None
    value = _number(flag, values[flag], float)
    _check_flag(value, flag)
    return value


def _check_flag(value: int | float, flag: str) -> None:
    """``value`` of ``flag`` against the trainer's meaning of it; :class:`TranslationError` (one line) otherwise."""
    m = {**_INT_MEANINGS, **_FLOAT_MEANINGS, "--from-gpus": mn.GPU_COUNT, "--to-gpus": mn.GPU_COUNT}[flag]
    try:
        check_meaning(value, m, flag)
    except ConfigError as e:
        raise TranslationError(str(e)) from None


def _check_numbers(values: dict[str, str]) -> None:
    """Every number the translator reads, as the trainer checks it: each flag by its meaning, then the adapter step
    ``(alpha / rank) x lr`` when all three are given (:func:`miles_ext.recipe.meanings.adapter_step_problem`)."""
    for flag in _INT_MEANINGS:
        _int(values, flag, None)
    floats = {flag: _float(values, flag) for flag in _FLOAT_MEANINGS}
    rank = _int(values, "--lora-rank", None)
    if rank is not None and floats["--lora-alpha"] is not None and floats["--lr"] is not None:
        why = mn.adapter_step_problem(rank, floats["--lora-alpha"], floats["--lr"])
        if why:
            raise TranslationError(why)


@dataclasses.dataclass(frozen=True)
class Translation:
    """The result of :func:`translate`."""

    args: list[str]
    """The M-GPU argument list."""
    changed: list[str]
    """One line per changed flag: what changed and why."""
    invariants: list[str]
    """One line per invariant: why it holds."""

    def render(self) -> str:
        """The CLI's stdout: the argument line, then ``# changed`` and ``# invariant`` lines."""
        lines = [shlex.join(self.args)]
        lines += [f"# changed {c}" for c in self.changed]
        lines += [f"# invariant {v}" for v in self.invariants]
        return "\n".join(lines) + "\n"


def _check_bf16_master(values: dict[str, str], present: set[str]) -> str:
    """The source's ``--fsdp-master-dtype`` (default fp32), after the checks that make a bf16 master exact here.

    Raises:
        TranslationError: a master dtype other than fp32/bf16; no ``--use-lora``; a non-bf16
            ``--diffusion-forward-dtype``; a DP split other than contiguous.
    """
    master = values.get("--fsdp-master-dtype", "fp32")
    if master not in ("fp32", "bf16"):
        raise TranslationError(f"--fsdp-master-dtype {master!r} is not fp32 or bf16; use one of those")
    if "--use-lora" not in present:
        raise TranslationError(
            "no --use-lora: a bf16 master would round the trained (non-LoRA) weights; add --use-lora "
            "(the H3 recipe is LoRA SFT) or translate to more GPUs keeping the fp32 master"
        )
    fwd = values.get("--diffusion-forward-dtype", "bf16")
    if fwd != "bf16":
        raise TranslationError(
            f"--diffusion-forward-dtype {fwd}: with a non-bf16 forward a bf16 master changes the gathered weights; "
            "use bf16 (the recipe default) or keep the source GPU count"
        )
    for flag in ("--train-dp-split-mode", "--diffusion-train-dp-split"):
        if values.get(flag, "contiguous") != "contiguous":
            raise TranslationError(
                f"{flag} {values[flag]}: only the contiguous DP split (the default) is emulated; drop the flag"
            )
    return master


def _invariants(values: dict[str, str], *, rbs: int, n: int, steps: int, gbs: int, mbs: int, from_gpus: int,
                to_gpus: int, master: str) -> list[str]:
    """The lines :class:`Translation` states as kept (global batch, micro-batches, gradient scale, steps per rollout,
    draws, LoRA, master dtype), for a translation :func:`translate` has checked."""
    per_rank = gbs // from_gpus
    mb_src, mb_dst = per_rank // mbs, gbs // to_gpus // mbs
    rank, alpha = values.get("--lora-rank", "(default)"), values.get("--lora-alpha", "(default)")
    return [
        f"global batch: {rbs} x {n} / {steps} = {gbs} samples per optimizer step on {from_gpus} and on {to_gpus} "
        f"GPU(s): rollout_batch_size x n_samples_per_prompt / num_steps_per_rollout has no world-size term "
        f"({gbs} divisible by {from_gpus} and {to_gpus})",
        f"micro-batches per optimizer step: {from_gpus} GPUs x {mb_src} per rank = {to_gpus} GPU(s) x {mb_dst} "
        f"accumulated = {gbs // mbs} micro-batches of {mbs}; none ragged",
        f"gradient scale: each rank backprops loss_sum / num_local_pairs per micro-batch and FSDP2 averages over "
        f"ranks: {from_gpus} GPUs: sum / {per_rank} / {from_gpus} = sum / {gbs}; {to_gpus} GPU(s): "
        f"sum / {gbs // to_gpus} / {to_gpus} = sum / {gbs}: the mean over the step's {gbs} pairs",
        f"optimizer steps per rollout: {rbs} x {n} / {gbs} = {steps} on both",
        f"draws: pair_schedule({gbs}, {from_gpus}, {steps}, {mbs}) gives micro-batch (j, i) of step s rank j's "
        f"contiguous pairs and seed stable_hash('sample', seed, rollout_id, s x {mb_src} + i, j): the "
        f"{from_gpus}-GPU run's timestep indices and noise"
        + (f"; GPU r runs source ranks j in [{from_gpus // to_gpus}r, {from_gpus // to_gpus}(r+1))" if to_gpus > 1 else ""),
        f"LoRA: --lora-rank {rank}, --lora-alpha {alpha} unchanged; adapters fp32 and trainable, initialised "
        f"as on an fp32 base",
        f"master dtype: {master} -> bf16 changes storage only: the base is frozen and gathered at "
        f"--diffusion-forward-dtype bf16 on both, bf16(fp32 w) == bf16(w) for the bf16 checkpoint tensors, "
        f"and the _keep_in_fp32_modules stay fp32",
    ]


def _rewritten(items: list[list[str]], values: dict[str, str], present: set[str], *, from_gpus: int, to_gpus: int,
               per_node: int | None, nodes: int | None, gbs: int, pin_gbs: bool, master: str
               ) -> tuple[list[str], list[str]]:
    """The translated argument list and the lines saying what changed, for a recipe :func:`translate` has checked:
    the GPU count, the bf16 master, the run names, ``--fsdp-cpu-offload`` and ``--onecard-emulate-dp-size`` (and the
    global batch, pinned where ``pin_gbs``: neither it nor the steps per rollout were set)."""
    changed: list[str] = []
    new_values: dict[str, str] = {
        "--actor-num-gpus-per-node": str(to_gpus),
        "--fsdp-master-dtype": "bf16",
    }
    if "--actor-num-nodes" in present:
        new_values["--actor-num-nodes"] = "1"
    for flag in RUN_NAME_FLAGS:
        if flag in values:
            new_values[flag] = f"onecard-{to_gpus}gpu-{values[flag]}"
    appended: list[list[str]] = []
    if "--actor-num-gpus-per-node" not in present:
        appended.append(["--actor-num-gpus-per-node", str(to_gpus)])
    if pin_gbs:
        appended.append(["--global-batch-size", str(gbs)])
        changed.append(
            f"--global-batch-size: (unset: defaults to the dp size {from_gpus}) -> {gbs}, pinned so the "
            f"{to_gpus}-GPU run does not default to {to_gpus}"
        )
    if "--fsdp-master-dtype" not in present:
        appended.append(["--fsdp-master-dtype", "bf16"])
    if "--fsdp-cpu-offload" not in present:
        appended.append(["--fsdp-cpu-offload"])
        changed.append("--fsdp-cpu-offload: added; sharded params, grads and optimizer state on the host. "
                       "Placement only: FSDP2 gathers the same values for the forward and accumulates grads by adding")
    appended.append(["--onecard-emulate-dp-size", str(from_gpus)])
    changed.append(
        f"--onecard-emulate-dp-size {from_gpus}: added (onecard flag); the trainer runs pair_schedule so that "
        f"micro-batch j of each step trains rank j's pairs with rank j's seed identity"
    )
    old_gpus = f"{per_node} x {nodes}" if per_node is not None else f"(unset; {from_gpus} from the launcher)"
    changed.insert(0, f"GPU count: --actor-num-gpus-per-node/--actor-num-nodes {old_gpus} -> {to_gpus} x 1")
    if master != "bf16":
        changed.insert(1, f"--fsdp-master-dtype: {master} -> bf16; the frozen base is stored bf16 "
                          "(_keep_in_fp32_modules stay fp32) and gathered as bf16 either way")
    for flag in RUN_NAME_FLAGS:
        if flag in values:
            changed.append(f"{flag}: {values[flag]} -> {new_values[flag]}")

    out: list[str] = []
    for item in items:
        if item[0] in new_values and len(item) == 2:
            out += [item[0], new_values[item[0]]]
        else:
            out += item
    for item in appended:
        out += item
    return out, changed


def translate(args: Sequence[str], from_gpus: int, to_gpus: int = 1) -> Translation:
    """Translate a ``from_gpus``-GPU recipe argument list to ``to_gpus`` GPUs (see the module docstring).

    Raises :class:`TranslationError` (one line: problem and fix) where an invariant would break: the GPU count
    disagrees with ``--actor-num-*``; batch sizes upstream would reject or that would split differently
    (global batch not divisible by either GPU count, ragged micro-batches, a contradicting
    ``--global-batch-size``); ``--fsdp-master-dtype`` outside fp32/bf16; no ``--use-lora`` (a bf16 master would
    round trained weights); ``--diffusion-forward-dtype`` other than bf16 (a bf16 master would then change the
    gathered weights); a stride DP split; ``--onecard-emulate-dp-size`` already set; ``to_gpus`` not dividing
    ``from_gpus`` (each GPU must emulate whole source ranks); ``--actor-num-nodes`` not dividing ``from_gpus``
    (without ``--actor-num-gpus-per-node``); an argument that is not valid UTF-8; a number the trainer would refuse
    (each flag it reads by the trainer's meaning of it, :mod:`miles_ext.recipe.meanings`: NaN, a count or rank below
    1, a GPU or node count <= 0, ``--lr`` above 1, an integer beyond 64 bits, digits that are not ASCII, spaces or
    underscores in a number, a rollout of more than 2**20 samples, ``(alpha / rank) x lr`` above 1).
    """
    if from_gpus < 1 or to_gpus < 1:
        raise TranslationError("--from-gpus and --to-gpus must be >= 1")
    for tok in args:
        try:
            tok.encode("utf-8")
        except UnicodeEncodeError:
            raise TranslationError(f"recipe argument {tok!r} is not valid UTF-8 (a byte the translated line could "
                                   "not be written with); fix the argument") from None
    _check_flag(from_gpus, "--from-gpus")
    _check_flag(to_gpus, "--to-gpus")
    if from_gpus % to_gpus:
        raise TranslationError(
            f"--to-gpus {to_gpus} does not divide --from-gpus {from_gpus}: each GPU must emulate whole source "
            "ranks; pick a divisor"
        )
    items, values, present = _scan(args)
    _check_numbers(values)

    per_node = _int(values, "--actor-num-gpus-per-node", None)
    nodes = _int(values, "--actor-num-nodes", 1)
    if per_node is not None and per_node * nodes != from_gpus:
        raise TranslationError(
            f"--actor-num-gpus-per-node {per_node} x --actor-num-nodes {nodes} = {per_node * nodes} GPUs, "
            f"but --from-gpus is {from_gpus}; make them agree"
        )
    if per_node is None and from_gpus % nodes:
        raise TranslationError(
            f"--actor-num-nodes {nodes} does not divide --from-gpus {from_gpus} (the same GPUs on every node); "
            "make them agree, or give --actor-num-gpus-per-node"
        )
    if "--onecard-emulate-dp-size" in values:
        raise TranslationError("--onecard-emulate-dp-size is already set: translate the original N-GPU recipe")
    rbs = _int(values, "--rollout-batch-size", None)
    if rbs is None:
        raise TranslationError("--rollout-batch-size is required to derive the global batch; add it")
    n = _int(values, "--n-samples-per-prompt", 1)
    nsteps = _int(values, "--num-steps-per-rollout", None)
    gbs_flag = _int(values, "--global-batch-size", None)
    mbs = _int(values, "--micro-batch-size", 1)
    assert n is not None and mbs is not None
    try:
        gbs, steps = derive_batch(rbs, from_gpus, n_samples_per_prompt=n, num_steps_per_rollout=nsteps,
                                  global_batch_size=gbs_flag)
        derive_batch(rbs, to_gpus, n_samples_per_prompt=n, num_steps_per_rollout=nsteps, global_batch_size=gbs)
        check_schedule(gbs, from_gpus, steps, mbs)
        check_schedule(gbs, to_gpus, steps, mbs)
    except ValueError as e:
        raise TranslationError(str(e)) from None

    master = _check_bf16_master(values, present)

    out, changed = _rewritten(items, values, present, from_gpus=from_gpus, to_gpus=to_gpus, per_node=per_node,
                              nodes=nodes, gbs=gbs, pin_gbs=gbs_flag is None and nsteps is None, master=master)
    invariants = _invariants(values, rbs=rbs, n=n, steps=steps, gbs=gbs, mbs=mbs, from_gpus=from_gpus,
                             to_gpus=to_gpus, master=master)
    return Translation(out, changed, invariants)


class _UsageError(UserError):
    """Bad CLI usage (reported like a refusal: one ``error:`` line, exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(message)


def _translate_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m miles_ext.recipe.translate", allow_abbrev=False, description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p
    t.add_argument("--from-gpus", type=_READ[int], required=True, help="GPU count of the source recipe (e.g. 8)")
    t.add_argument("--to-gpus", type=_READ[int], default=1, help="GPU count to run on (default 1)")
    t.add_argument("--out", type=Path, default=None, help="also write the translated argument line here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 2 refused or bad usage).

    Options of the translator itself are ``--from-gpus``, ``--to-gpus`` and ``--out``; every other token is a
    recipe argument (``--`` may separate them explicitly).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    return cli(lambda: _translate_command(argv))


def _translate_command(argv: list[str]) -> int:
    """Parse, translate, write ``--out``, print; :class:`UserError` on a refusal or bad usage."""
    parser = _translate_parser()
    if "--" in argv:
        cut = argv.index("--")
        ns, rest = parser.parse_known_args(argv[:cut])
        rest += argv[cut + 1 :]
    else:
        ns, rest = parser.parse_known_args(argv)
    result = translate(rest, ns.from_gpus, ns.to_gpus)
    if ns.out is not None:
        try:
            atomic_write_text(ns.out, shlex.join(result.args) + "\n")
        except OSError as e:
            raise UserError(f"cannot write --out {ns.out}: {e.strerror}; pick a writable path") from None
    sys.stdout.write(result.render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
