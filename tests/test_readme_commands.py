"""README's commands run as written (those that finish on a CPU in seconds and no other test runs as written).

Each command is taken from README.md's text, not retyped here, and run by ``bash`` in a scratch folder that
links ``toml/`` and ``launchers/`` (so README's relative paths work and nothing is written into the checkout).
What README says about the result is checked too. Commands covered elsewhere: ``python -m patches status``
(``test_guard.py``, ``test_attention_flag.py``), the translator (``test_h3_recipe_cli.py``), the export and the
adapter-loading snippet (``test_h3_export_lora.py``); the main jobs run in ``.ci/run``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DOCS = README + "".join(p.read_text() for p in sorted((REPO / "docs").rglob("*.md")))
"""README and every docs page: a command is run from wherever the docs show it."""


def readme_line(contains: str) -> str:
    """The one command line of the code blocks of README and ``docs/`` that holds ``contains`` (a trailing comment and
    a ``\\`` continuation cut; a ``$ `` prompt dropped)."""
    lines, inside = [], False
    for line in DOCS.splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside and contains in line and not line.lstrip().startswith("#"):
            lines.append(re.sub(r"\s+#.*$", "", line.removeprefix("$ ")).rstrip(" \\"))
    assert len(set(lines)) == 1, (contains, lines)
    return lines[0]


@pytest.fixture()
def scratch(tmp_path: Path) -> Path:
    for name in ("toml", "launchers"):
        (tmp_path / name).symlink_to(REPO / name)
    return tmp_path


def sh(cwd: Path, command: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("COSMOS_EMA_CPU_SUBSET", "COSMOS_VAE_CPU_OFFLOAD", "DRYRUN",
                                                           "TOML_FILE", "MEMTEST", "EMAVAL", "DATASET_PATH")}
    e.update(PYTHON=sys.executable, PATH=f"{Path(sys.executable).parent}:{e.get('PATH', '')}", **env)
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=e, capture_output=True, text=True, timeout=300)


def test_ledger_command_answers_with_the_lever_that_closes_the_gap(scratch):
    cmd = readme_line("python -m patches.ledger --toml toml/vision_sft_edge_24gb.toml")
    r = sh(scratch, cmd)
    if "COSMOS_EMA_CPU_SUBSET=1" in cmd:  # README: "With both levers it predicts 16.9 GiB allocated ... which fits"
        assert r.returncode == 0 and "FITS" in r.stdout and "DOES NOT FIT" not in r.stdout, r.stdout + r.stderr
    else:  # README: "With no levers ... the ledger answers `set COSMOS_EMA_CPU_SUBSET=1`"; exit 1 on no fit
        assert r.returncode == 1 and "to fit: set COSMOS_EMA_CPU_SUBSET=1" in r.stdout, r.stdout + r.stderr


def test_own_recipe_toml_copy_and_dryrun(scratch):
    cp = readme_line("cp toml/vision_sft_edge_24gb.toml my_recipe.toml")
    dry = readme_line("DRYRUN=1 TOML_FILE=my_recipe.toml")
    r = sh(scratch, f"{cp} && {dry}")
    assert r.returncode == 0 and "FITS" in r.stdout and "DOES NOT FIT" not in r.stdout, r.stdout + r.stderr
    assert (scratch / "my_recipe.toml").read_text() == (REPO / "toml" / "vision_sft_edge_24gb.toml").read_text()
    assert not (scratch / "outputs").exists()  # a dry run writes nothing


def test_packing_planner_command_gives_readmes_grad_accum_on_the_sample_dataset(scratch):
    cmd = readme_line("python -m cosmos_framework_ext.recipe.plan --cap 12288")
    r = sh(scratch, f"{cmd} --json plan.json", ONECARD_DATA_CACHE=str(scratch / "cache"))
    assert r.returncode == 0, r.stderr
    plan = json.loads((scratch / "plan.json").read_text())
    # README: "On the 67-row sample dataset the planner gives grad_accum 6"
    assert plan["num_samples"] == 67 and plan["grad_accum"] == 6 and plan["ours"]["dropped"] == []
    assert "grad_accum 6" in DOCS
