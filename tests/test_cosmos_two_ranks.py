"""The embedded Cosmos trainer at ``NPROC_PER_NODE=2`` (gloo, FSDP2 on the CPU), through the launcher.

A checkpoint holds the full tensors (every ``net.*`` and ``net_ema.*`` entry has the model's shape, not one
rank's shard), and resuming a 2-rank run from its step-2 checkpoint gives step 3 bit for bit as the straight
2-rank run does (weights, EMA, optimizer state, loss). The straight run goes through the launcher; the resumed
one runs the trainer's ``main`` in two ranks forked from a preloaded forkserver with torchrun's environment
(:func:`tests.equivalence.h3_ranks.launch` with ``group=False``), which saves torchrun's and two ranks' start-up.
The launcher run leaves ``MASTER_PORT`` unset while torchrun's usual fixed ports are taken: a one-node run picks a
free port itself. (NCCL on two GPUs is not covered: the CI machine has no GPU.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import torch

from cosmos_framework_ext.recipe import train  # preloaded in the ranks' forkserver
from patches.core.checkpoint import CheckpointManager
from tests.equivalence.h3_ranks import launch

REPO = Path(__file__).resolve().parents[1]
JOB = ("cosmos3", "sft", "vision_sft_edge_24gb")


def _toml(tmp_path: Path) -> Path:
    text = (REPO / "toml" / "vision_sft_edge_24gb.toml").read_text()
    for key, value in {"cpu_grad_accum_iter": "1", "cpu_max_sequence_length": "300", "save_iter": "2"}.items():
        text, n = re.subn(rf"^{key}(\s*)=.*$", rf"{key}\g<1>= {value}", text, flags=re.M)
        assert n == 1, key
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return path


_DROP = ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "COSMOS_FRAMEWORK_ROOT", "NNODES")


def _env(tmp_path: Path, out: Path, toml: Path, dataset: Path) -> dict[str, str]:
    return dict(NPROC_PER_NODE="2", OUTPUT_ROOT=str(out), TOML_FILE=str(toml), DATASET_PATH=str(dataset),
                COSMOS_EMA_CPU_SUBSET="1", COSMOS_VAE_CPU_OFFLOAD="1", PYTHON=sys.executable,
                ONECARD_DATA_CACHE=str(tmp_path / "cache"))


def _launch(tmp_path: Path, out: Path, toml: Path, dataset: Path) -> subprocess.CompletedProcess:
    """The launcher at ``NPROC_PER_NODE=2``."""
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env.update(_env(tmp_path, out, toml, dataset))
    return subprocess.run(["bash", str(REPO / "launchers" / "sft_edge_24gb.sh"), "--max-iter", "3"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)


def _train_rank(rank: int, world: int, env: dict[str, str], argv: list[str], log: str) -> None:
    """One rank of the resumed run: the trainer's ``main`` as torchrun would start it; rank 0's stdout to ``log``."""
    for key in ("COSMOS_FRAMEWORK_ROOT", "NNODES"):  # the rendezvous variables are launch()'s
        os.environ.pop(key, None)
    os.environ.update(env)
    with open(log if rank == 0 else os.devnull, "w") as out, contextlib.redirect_stdout(out):
        code = train.main(argv)
    assert code == 0, f"rank {rank} exited with {code}"


@contextlib.contextmanager
def _fixed_ports_taken():
    """Hold torchrun's default 29500 and upstream's 50012 (where free) for the block."""
    with contextlib.ExitStack() as stack:
        for port in (29500, 50012):
            s = stack.enter_context(socket.socket())
            with contextlib.suppress(OSError):
                s.bind(("127.0.0.1", port))
                s.listen()
        yield


def test_two_rank_checkpoints_are_full_and_a_resume_is_exact(tmp_path, small_dataset, monkeypatch):
    from cosmos_framework_ext.recipe.presets import build_transformer, get_preset

    toml = _toml(tmp_path)
    with _fixed_ports_taken():
        straight = _launch(tmp_path, tmp_path / "straight", toml, small_dataset)
    assert straight.returncode == 0, straight.stderr[-4000:]
    assert "2 rank(s)" in straight.stdout
    m = CheckpointManager(tmp_path / "straight" / Path(*JOB))
    assert [s for s, _ in m.all()] == [2, 3]

    shapes = {k: tuple(v.shape) for k, v in build_transformer(get_preset("tiny"), device="meta").state_dict().items()}
    three = torch.load(m.path(3), weights_only=False)
    got = {k: tuple(v.shape) for k, v in three["model"].items()}
    assert got == {**{f"net.{k}": s for k, s in shapes.items()}, **{f"net_ema.{k}": s for k, s in shapes.items()}}
    assert three["training_settings"]["world size (NPROC_PER_NODE x NNODES)"] == 2
    assert all(isinstance(k, str) for k in three["optimizer"]["state"])  # keyed by name: loads at any world size

    resumed = CheckpointManager(tmp_path / "resumed" / Path(*JOB))
    resumed.save(2, torch.load(m.path(2), weights_only=False))  # the straight run's step-2 checkpoint alone
    log = tmp_path / "resumed.log"
    monkeypatch.chdir(tmp_path)
    launch(_train_rank, 2, _env(tmp_path, tmp_path / "resumed", toml, small_dataset),
           [f"--sft-toml={toml}", "--videos-checked", "--max-iter", "3"], str(log), group=False)
    assert f"resumed from {resumed.path(2)} at iteration 2" in log.read_text()

    other = torch.load(resumed.path(3), weights_only=False)
    assert other["model"].keys() == three["model"].keys()
    differ = [k for k in three["model"] if not torch.equal(three["model"][k], other["model"][k])]
    assert not differ, differ[:5]
    for name, st in three["optimizer"]["state"].items():
        assert all(torch.equal(v, other["optimizer"]["state"][name][k]) for k, v in st.items()), name
    assert other["ema_num_updates"] == three["ema_num_updates"] == 3
    loss = [json.loads((tmp_path / run / Path(*JOB) / "summary.json").read_text())["last_loss"]
            for run in ("straight", "resumed")]
    assert loss[0] == loss[1]
