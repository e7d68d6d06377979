"""``COSMOS_ATTN_BACKEND``: the choice flag, its table entry, and the patch on a stand-in frontend (no upstream).

The stand-in frontend below behaves as upstream's ``cosmos_framework.model.attention.frontend`` does where
it matters here: ``attention()`` asks the module-level ``choose_backend`` for a name at every call and
calls ``BACKEND_MAP[name]`` with the backends' keyword arguments; with no usable backend it raises
"Could not find a compatible Attention backend".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from patches.core import flags
from patches.core.flags import ATTN_BACKEND, Choice, ChoiceFlag, FlagError
from patches.core.errors import UpstreamMismatch
from patches.guard import MARK, resolve

from tests.cli import run_main
from tests.cosmos_stub import write_checkout

REPO = Path(__file__).resolve().parents[1]
TARGET = "cosmos_framework.model.attention.frontend:choose_backend"
CHOOSE_BACKEND_PARAMS = ("query_shape", "key_shape", "value_shape", "dtype", "device", "requires_grad", "is_causal",
                         "causal_type", "is_varlen", "deterministic", "backend", "raise_error")

FRONTEND_SOURCE = textwrap.dedent('''
    """Stand-in for cosmos_framework.model.attention.frontend: dispatch through choose_backend and BACKEND_MAP."""


    def _upstream_backend(query, key, value, is_causal=False, causal_type=None, scale=None, cumulative_seqlen_Q=None,
                          cumulative_seqlen_KV=None, max_seqlen_Q=None, max_seqlen_KV=None, return_lse=False,
                          backend_kwargs=None, deterministic=False):
        raise RuntimeError("the upstream kernel is not installed here")


    BACKEND_MAP = {"flash2": _upstream_backend}


    def choose_backend(query_shape, key_shape, value_shape, dtype, device, requires_grad, is_causal, causal_type,
                       is_varlen, deterministic=False, backend=None, raise_error=True):
        if backend is not None:
            return backend
        if raise_error:
            raise ValueError("Could not find a compatible Attention backend for this use case / device.")
        return None


    def attention(query, key, value, is_causal=False, causal_type=None, scale=None, seqlens_Q=None, seqlens_KV=None,
                  cumulative_seqlen_Q=None, cumulative_seqlen_KV=None, max_seqlen_Q=None, max_seqlen_KV=None,
                  backend=None, return_lse=False, backend_kwargs=None, deterministic=False):
        name = choose_backend(query.shape, key.shape, value.shape, query.dtype, query.device, query.requires_grad,
                              is_causal, causal_type, cumulative_seqlen_Q is not None, deterministic=deterministic,
                              backend=backend, raise_error=False)
        if name is None:
            raise ValueError("Could not find a compatible Attention backend for this use case / device.")
        return BACKEND_MAP[name](query=query, key=key, value=value, is_causal=is_causal, causal_type=causal_type,
                                 scale=scale if scale is not None else query.shape[-1] ** -0.5,
                                 cumulative_seqlen_Q=cumulative_seqlen_Q, cumulative_seqlen_KV=cumulative_seqlen_KV,
                                 max_seqlen_Q=max_seqlen_Q, max_seqlen_KV=max_seqlen_KV, return_lse=return_lse,
                                 backend_kwargs=backend_kwargs, deterministic=deterministic)
''')


def _write_checkout(root: Path, frontend: str = FRONTEND_SOURCE) -> None:
    """A stand-in checkout: every table target with its supported signature, and the attention frontend."""
    write_checkout(root, frontend=frontend)
    cf = root / "cosmos_framework"
    (cf / "model" / "attention" / "__init__.py").write_text(
        "from cosmos_framework.model.attention.frontend import attention\n")
    # what the model does: bind attention at import, then call it on a packed causal GQA input
    (cf / "probe.py").write_text(textwrap.dedent('''
        import enum
        import torch
        from cosmos_framework.model.attention import attention

        CausalType = enum.Enum("CausalType", ["TopLeft", "BottomRight", "DontCare"])
        g = torch.Generator().manual_seed(0)
        q, k, v = torch.randn(1, 9, 4, 8, generator=g), torch.randn(1, 9, 2, 8, generator=g), torch.randn(1, 9, 2, 8, generator=g)
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        out = attention(q, k, v, is_causal=True, causal_type=CausalType.DontCare, cumulative_seqlen_Q=cu,
                        cumulative_seqlen_KV=cu, max_seqlen_Q=5, max_seqlen_KV=5)
        first = torch.nn.functional.scaled_dot_product_attention(
            q[:, :4].transpose(1, 2), k[:, :4].repeat_interleave(2, 2).transpose(1, 2),
            v[:, :4].repeat_interleave(2, 2).transpose(1, 2), is_causal=True).transpose(1, 2)
        print("probe: attention ran, first sequence max error", float((out[:, :4] - first).abs().max()))
    '''))


@pytest.fixture()
def frontend(monkeypatch, tmp_path):
    """The stand-in frontend imported as ``cosmos_framework.model.attention.frontend`` (removed afterwards)."""
    for name in [m for m in sys.modules if m == "cosmos_framework" or m.startswith("cosmos_framework.")]:
        monkeypatch.delitem(sys.modules, name)
    _write_checkout(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import cosmos_framework.model.attention.frontend as fe

    yield fe
    for name in [m for m in sys.modules if m == "cosmos_framework" or m.startswith("cosmos_framework.")]:
        del sys.modules[name]  # the stand-ins; monkeypatch then puts back any real ones it took out


def _qkv():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 6, 4, 8, generator=g), torch.randn(1, 6, 2, 8, generator=g), torch.randn(1, 6, 2, 8, generator=g)


# ---------------------------------------------------------------------------------------------- the flag
@pytest.mark.parametrize("raw, want", [(None, ""), ("", ""), ("  ", ""), ("torch", "torch"), (" Torch ", "torch")])
def test_choice_flag_parses_unset_empty_and_torch(raw, want):
    env = {} if raw is None else {ATTN_BACKEND.name: raw}
    value = ATTN_BACKEND.value(env)
    assert isinstance(value, Choice) and value == want
    assert bool(value) == bool(want) and int(value) == (1 if want else 0)


@pytest.mark.parametrize("raw", ["1", "flash", "sdpa", "torch,cudnn"])
def test_bad_choice_names_the_variable_and_the_accepted_values(raw):
    with pytest.raises(FlagError) as e:
        ATTN_BACKEND.value({ATTN_BACKEND.name: raw})
    msg = str(e.value)
    assert msg.startswith(f"COSMOS_ATTN_BACKEND={raw!r}") and "torch" in msg and "unset" in msg


def test_read_all_carries_the_choice_for_wanted_and_run():
    assert isinstance(ATTN_BACKEND, ChoiceFlag) and ATTN_BACKEND in flags.ALL_FLAGS
    off = flags.read_all({})
    on = flags.read_all({ATTN_BACKEND.name: "torch"})
    assert off[ATTN_BACKEND.name] == "" and not off[ATTN_BACKEND.name]
    assert on[ATTN_BACKEND.name] == "torch" and on[ATTN_BACKEND.name]
    assert not any(off.values()) and any(on.values())  # patches.run: nothing to patch unless a flag is on
    assert "COSMOS_ATTN_BACKEND=1" in " ".join(f"{k}={int(v)}" for k, v in on.items()).split()  # patches.run's line
    assert json.loads(json.dumps(on))[ATTN_BACKEND.name] == "torch"  # the trainer's summary JSON
    with pytest.raises(FlagError, match="COSMOS_ATTN_BACKEND"):
        flags.read_all({ATTN_BACKEND.name: "flash3"})


# ---------------------------------------------------------------------------------------------- the table
def _entry():
    from patches.cosmos_table import PATCHES

    found = [p for p in PATCHES if p.flag is ATTN_BACKEND]
    assert len(found) == 1
    return found[0]


def test_table_entry_names_the_frontend_choose_backend():
    p = _entry()
    assert p.target == TARGET
    assert p.params == (CHOOSE_BACKEND_PARAMS,)  # the same at ed8287f and 5eee9ed
    assert callable(resolve(p.impl))
    from patches.cosmos_table import patch_set

    ps = patch_set()
    assert p not in ps.wanted(flags.read_all({}))
    assert ps.wanted(flags.read_all({ATTN_BACKEND.name: "torch"})) == [p]


def test_unset_flag_leaves_the_frontend_untouched(frontend):
    from patches.cosmos_table import patch_set

    before, backends = frontend.choose_backend, dict(frontend.BACKEND_MAP)
    assert patch_set().apply(flags.read_all({})) == []
    assert frontend.choose_backend is before and frontend.BACKEND_MAP == backends
    with pytest.raises(ValueError, match="Could not find a compatible Attention backend"):
        frontend.attention(*_qkv())


def test_flag_on_routes_every_importer_to_torch_and_revert_restores(frontend):
    from cosmos_framework.model.attention import attention as bound_before_the_patch
    from cosmos_framework_ext.upstream.attention import torch_attention
    from patches.cosmos_table import patch_set

    before, backends = frontend.choose_backend, dict(frontend.BACKEND_MAP)
    ps = patch_set()
    assert ps.apply(flags.read_all({ATTN_BACKEND.name: "torch"})) == [TARGET]
    assert getattr(frontend.choose_backend, MARK) == "attention.choose_backend"
    assert frontend.BACKEND_MAP["torch"] is torch_attention and frontend.BACKEND_MAP["flash2"] is backends["flash2"]
    q, k, v = _qkv()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2), v.repeat_interleave(2, 2).transpose(1, 2)
    ).transpose(1, 2)
    torch.testing.assert_close(bound_before_the_patch(q, k, v), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(frontend.attention(q, k, v, backend="torch"), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="not installed"):  # an explicit other backend: upstream's own choice
        frontend.attention(q, k, v, backend="flash2")
    assert [s for s in ps.status() if s[2]] == [("attention.choose_backend", TARGET, True)]
    ps.apply(flags.read_all({ATTN_BACKEND.name: "torch"}))  # a second apply wraps nothing twice
    assert frontend.choose_backend.__wrapped__ is before
    ps.revert()
    assert frontend.choose_backend is before and frontend.BACKEND_MAP == backends
    with pytest.raises(ValueError, match="Could not find a compatible Attention backend"):
        bound_before_the_patch(q, k, v)


def test_changed_choose_backend_signature_is_refused_by_name(frontend):
    from patches.cosmos_table import patch_set

    frontend.choose_backend = lambda query_shape, key_shape, value_shape, dtype, device, backend=None: None
    with pytest.raises(UpstreamMismatch) as e:
        patch_set().apply(flags.read_all({ATTN_BACKEND.name: "torch"}))
    assert TARGET in str(e.value) and "COSMOS_ATTN_BACKEND" in str(e.value) and "ed8287f" in str(e.value)
    assert "torch" not in frontend.BACKEND_MAP


def test_backends_called_differently_are_refused(frontend):
    from patches.cosmos_table import patch_set

    frontend.BACKEND_MAP["flash2"] = lambda query, key, value, window_size=None: None
    with pytest.raises(UpstreamMismatch, match=r"BACKEND_MAP\['flash2'\].*COSMOS_ATTN_BACKEND"):
        patch_set().apply(flags.read_all({ATTN_BACKEND.name: "torch"}))
    assert "torch" not in frontend.BACKEND_MAP and not hasattr(frontend.choose_backend, MARK)


# ---------------------------------------------------------------------------------------------- the commands
def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSMOS_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def test_status_shows_the_flag_and_its_target(tmp_path):
    _write_checkout(tmp_path)

    def status(**extra: str) -> subprocess.CompletedProcess:  # in this process, the stand-in checkout isolated
        return run_main("patches.__main__", ["status"], _env(**extra), REPO, isolate=("cosmos_framework",))

    r = status()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "COSMOS_ATTN_BACKEND=(unset" in r.stdout
    r = status(COSMOS_FRAMEWORK_ROOT=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"attention.choose_backend     {TARGET}: ok, left alone (COSMOS_ATTN_BACKEND unset)" in r.stdout
    r = status(COSMOS_FRAMEWORK_ROOT=str(tmp_path), COSMOS_ATTN_BACKEND="torch")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "COSMOS_ATTN_BACKEND=torch" in r.stdout and f"{TARGET}: ok, would be patched" in r.stdout
    r = status(COSMOS_ATTN_BACKEND="flash")
    assert r.returncode == 2 and r.stderr.count("error:") == 1 and "COSMOS_ATTN_BACKEND='flash'" in r.stderr


def test_run_applies_it_before_the_model_imports_attention(tmp_path):
    _write_checkout(tmp_path)
    cmd = [sys.executable, "-m", "patches.run", "cosmos_framework.probe"]
    r = subprocess.run(cmd, env=_env(COSMOS_FRAMEWORK_ROOT=str(tmp_path), COSMOS_ATTN_BACKEND="torch"),
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "COSMOS_ATTN_BACKEND=torch" in r.stderr and f"patched: {TARGET}" in r.stderr
    err = float(r.stdout.rsplit(" ", 1)[-1])
    assert "probe: attention ran" in r.stdout and err < 1e-5
    stock = _env(COSMOS_FRAMEWORK_ROOT=str(tmp_path))
    stock["PYTHONPATH"] = str(tmp_path) + os.pathsep + stock["PYTHONPATH"]  # as the launcher sets it
    r = subprocess.run(cmd, env=stock, capture_output=True, text=True, cwd=REPO)
    assert r.returncode != 0 and "Could not find a compatible Attention backend" in r.stderr  # unset: stock
    r = subprocess.run(cmd, env=_env(COSMOS_FRAMEWORK_ROOT=str(tmp_path), COSMOS_ATTN_BACKEND="cudnn"),
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and r.stderr.count("error:") == 1 and "COSMOS_ATTN_BACKEND='cudnn'" in r.stderr
