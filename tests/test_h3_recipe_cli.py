"""The translator's command line, ``python -m miles_ext.recipe.translate``: the 8-GPU H3 SFT recipe's
arguments -> 1 GPU, and its refusals (the 8->1 schedule itself is proved in
``tests/equivalence/test_h3_recipe.py``)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from miles_ext.recipe.schedule import derive_batch
from miles_ext.recipe.translate import TranslationError, main, translate
from patches.core.errors import UserError

ROOT = Path(__file__).resolve().parents[1]

# The 8-GPU H3 LoRA SFT recipe (upstream flag names; the rest passes through).
RECIPE_8 = [
    "--rollout-batch-size", "32",
    "--n-samples-per-prompt", "1",
    "--num-steps-per-rollout", "4",
    "--micro-batch-size", "1",
    "--actor-num-gpus-per-node", "8",
    "--actor-num-nodes", "1",
    "--fsdp-master-dtype", "fp32",
    "--use-lora",
    "--lora-rank", "64",
    "--lora-alpha", "128",
    "--loss-type", "sft_loss",
    "--train-only",
    "--run-name", "h3-t2va-sft",
    "--lr=1e-4",
    "--custom-loss-function-path", "miles.backends.fsdp_utils.loss_hub.sft.sft_loss_formula",
    "--seed", "42",
]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _flag(args: list[str], name: str) -> str | None:
    """Value of the last occurrence of ``name`` (``--x v`` or ``--x=v``)."""
    val = None
    for i, tok in enumerate(args):
        if tok == name and i + 1 < len(args):
            val = args[i + 1]
        elif tok.startswith(name + "="):
            val = tok.split("=", 1)[1]
    return val


def test_translation_changes_only_what_must_change(capsys):
    rc, out, err = _run(capsys, "--from-gpus", "8", "--to-gpus", "1", *RECIPE_8)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    args = shlex.split(lines[0])
    assert _flag(args, "--actor-num-gpus-per-node") == "1" and _flag(args, "--actor-num-nodes") == "1"
    assert _flag(args, "--fsdp-master-dtype") == "bf16" and "--fsdp-cpu-offload" in args
    assert _flag(args, "--run-name") == "onecard-1gpu-h3-t2va-sft"
    assert _flag(args, "--onecard-emulate-dp-size") == "8"
    # everything else unchanged, in order
    changed = {"--actor-num-gpus-per-node", "--actor-num-nodes", "--fsdp-master-dtype", "--run-name"}
    kept = [t for i, t in enumerate(RECIPE_8) if t not in changed and (i == 0 or RECIPE_8[i - 1] not in changed)]
    got = [t for i, t in enumerate(args) if t not in changed and (i == 0 or args[i - 1] not in changed)]
    assert got[: len(kept)] == kept
    assert got[len(kept):] == ["--fsdp-cpu-offload", "--onecard-emulate-dp-size", "8"]
    assert _flag(args, "--global-batch-size") is None  # derived from num_steps_per_rollout, no need to pin
    assert all(line.startswith("# changed ") or line.startswith("# invariant ") for line in lines[1:])


def test_invariants_are_printed_with_their_reasons(capsys):
    rc, out, _ = _run(capsys, "--from-gpus", "8", *RECIPE_8)
    inv = [line for line in out.splitlines() if line.startswith("# invariant ")]
    text = "\n".join(inv)
    assert "global batch: 32 x 1 / 4 = 8 samples per optimizer step" in text and "no world-size term" in text
    assert "8 GPUs x 1 per rank = 1 GPU(s) x 8 accumulated" in text
    assert "loss_sum / num_local_pairs" in text and "sum / 8" in text
    assert "optimizer steps per rollout: 32 x 1 / 8 = 4" in text
    assert "pair_schedule(8, 8, 4, 1)" in text
    assert "--lora-rank 64, --lora-alpha 128 unchanged" in text
    assert len(inv) == 7


def test_global_batch_is_pinned_when_it_defaulted_to_the_dp_size(capsys):
    args = ["--rollout-batch-size", "32", "--use-lora", "--actor-num-gpus-per-node", "8"]
    rc, out, _ = _run(capsys, "--from-gpus", "8", *args)
    assert rc == 0
    new = shlex.split(out.splitlines()[0])
    assert _flag(new, "--global-batch-size") == "8"  # would default to 1 on one GPU
    assert derive_batch(32, 1, global_batch_size=8) == derive_batch(32, 8) == (8, 4)


def test_equals_form_last_occurrence_and_unknown_flags(capsys):
    args = ["--rollout-batch-size=32", "--num-steps-per-rollout", "4", "--use-lora", "--fsdp-master-dtype=bf16",
            "--foo", "bar", "--run-name", "a", "--run-name=b", "--bare-flag", "--actor-num-gpus-per-node=8"]
    rc, out, _ = _run(capsys, "--from-gpus", "8", *args)
    assert rc == 0
    new = shlex.split(out.splitlines()[0])
    assert new[: 5] == ["--rollout-batch-size", "32", "--num-steps-per-rollout", "4", "--use-lora"]
    assert ["--foo", "bar"] == new[new.index("--foo"): new.index("--foo") + 2] and "--bare-flag" in new
    assert _flag(new, "--run-name") == "onecard-1gpu-b"
    assert "# changed --fsdp-master-dtype" not in out  # already bf16


def test_out_file_is_written_on_success(tmp_path, capsys):
    out_file = tmp_path / "args.txt"
    rc, out, _ = _run(capsys, "--from-gpus", "8", "--out", str(out_file), *RECIPE_8)
    assert rc == 0 and out_file.read_text() == out.splitlines()[0] + "\n"


@pytest.mark.parametrize(
    "edit,needle",
    [
        ({"--rollout-batch-size": "36"}, "not divisible by the GPU count 8"),
        ({"--rollout-batch-size": "30"}, "not divisible by num_steps_per_rollout"),
        ({"--fsdp-master-dtype": "fp16"}, "--fsdp-master-dtype 'fp16' is not fp32 or bf16"),
        ({"--global-batch-size": "16"}, "contradicts"),
        ({"--micro-batch-size": "2"}, "ragged"),
        ({"--actor-num-gpus-per-node": "4"}, "make them agree"),
        ({"--use-lora": None}, "add --use-lora"),
        ({"--diffusion-forward-dtype": "fp32"}, "--diffusion-forward-dtype fp32"),
        ({"--train-dp-split-mode": "stride"}, "only the contiguous DP split"),
        ({"--rollout-batch-size": None}, "--rollout-batch-size is required"),
        ({"--lora-rank": "x", "--rollout-batch-size": "x"}, "invalid int value"),
    ],
)
def test_refusals_exit_2_with_one_error_line_and_write_nothing(tmp_path, capsys, edit, needle):
    args = list(RECIPE_8)
    for flag, value in edit.items():
        if flag in args:
            i = args.index(flag)
            if value is None:
                del args[i : i + (1 if flag == "--use-lora" else 2)]
            else:
                args[i + 1] = value
        elif value is not None:
            args += [flag, value]
    out_file = tmp_path / "args.txt"
    rc, out, err = _run(capsys, "--from-gpus", "8", "--out", str(out_file), *args)
    assert rc == 2 and out == "" and not out_file.exists() and not list(tmp_path.iterdir())
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err, err


def test_bad_usage_is_refused_the_same_way(capsys):
    for argv in ([*RECIPE_8], ["--from-gpus", "x", *RECIPE_8], ["nope"],
                 ["--from-gpus", "8", "--to-gpus", "0", *RECIPE_8],
                 ["--from-gpus", "8", "--to-gpus", "3", *RECIPE_8],
                 ["--from-gpus", "8", "--rollout-batch-size"]):
        rc, out, err = _run(capsys, *argv)
        assert rc == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, (argv, err)


def test_translate_to_two_gpus(capsys):
    rc, out, _ = _run(capsys, "--from-gpus", "8", "--to-gpus", "2", *RECIPE_8)
    assert rc == 0 and _flag(shlex.split(out.splitlines()[0]), "--actor-num-gpus-per-node") == "2"
    assert "8 GPUs x 1 per rank = 2 GPU(s) x 4 accumulated" in out
    assert "GPU r runs source ranks j in [4r, 4(r+1))" in out


def test_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "miles_ext.recipe.translate", "--from-gpus", "8", *RECIPE_8],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.splitlines()[0].startswith("--rollout-batch-size 32")
    bad = subprocess.run([sys.executable, "-m", "miles_ext.recipe.translate", "--from-gpus", "8",
                          "--rollout-batch-size", "36", "--use-lora"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.startswith("error: ")


def test_translate_function_api():
    t = translate(RECIPE_8, from_gpus=8, to_gpus=1)
    assert t.args[:2] == ["--rollout-batch-size", "32"] and len(t.invariants) == 7 and t.changed
    with pytest.raises(UserError):  # TranslationError is the shared bad-input type (and still a ValueError)
        translate(RECIPE_8, from_gpus=8, to_gpus=3)
    assert issubclass(TranslationError, UserError) and issubclass(TranslationError, ValueError)


def test_multi_node_gpu_count_is_per_node_times_nodes():
    """``--actor-num-gpus-per-node 4 --actor-num-nodes 2`` is 4 x 2 = 8 GPUs (the translator's docstring: the GPU
    count must agree with ``--actor-num-*``): it translates ``--from-gpus 8`` and is refused for ``--from-gpus 4``.
    The translated set runs on one node: ``--actor-num-gpus-per-node 1 --actor-num-nodes 1`` (4 x 1 would ask the
    launcher for the source run's node count again)."""
    args = list(RECIPE_8)
    args[args.index("--actor-num-gpus-per-node") + 1] = "4"
    args[args.index("--actor-num-nodes") + 1] = "2"
    t = translate(args, from_gpus=8, to_gpus=1)
    assert _flag(t.args, "--actor-num-gpus-per-node") == "1" and _flag(t.args, "--actor-num-nodes") == "1"
    assert t.args.count("--actor-num-nodes") == 1 and _flag(t.args, "--onecard-emulate-dp-size") == "8"
    assert "--actor-num-gpus-per-node/--actor-num-nodes 4 x 2 -> 1 x 1" in t.changed[0]
    with pytest.raises(TranslationError, match=r"4 x --actor-num-nodes 2 = 8 GPUs, but --from-gpus is 4"):
        translate(args, from_gpus=4, to_gpus=1)
    t2 = translate(args, from_gpus=8, to_gpus=2)
    assert _flag(t2.args, "--actor-num-gpus-per-node") == "2" and _flag(t2.args, "--actor-num-nodes") == "1"
