"""Background threads on a share of the cores train exactly what threads on all of them train.

``[onecard] background_threads`` caps the intra-op CPU threads of the training loop's background threads -- the
loader threads that build the next micro-batches' host inputs and the EMA's host lerp -- each at its own count
(:func:`patches.core.threads.cap_this_thread`), so their CPU operators leave cores to the thread that launches the
GPU's work. The values cannot depend on it: the operators these threads run compute each element the same way
whatever the size of the team that runs them.

- **Exact, CPU:** the tiny recipe (4 optimizer steps, EMA, latent cache, inputs built ahead) with ``"auto"`` (one
  thread each on a 2-core machine) equals the anchor, the same run uncapped (``"all"``, PyTorch's default: one per
  core each, the trainer before this setting): every loss and every checkpoint tensor ``torch.equal``, the EMA's
  included.
- **Where the cap holds:** in that run every loader call and every EMA lerp ran with the cap
  (``torch.get_num_threads()`` read inside them), and the main thread kept its count; a thread capped by
  :func:`cap_this_thread` changes neither the main thread nor a thread started after it.
- **The lerp itself:** an EMA host lerp over a tensor large enough to be split across threads gives the same fp32
  bits on one thread as on every core, and both equal the formula computed apart in float64 and rounded.

Planted: a cap set with ``torch.set_num_threads`` (process-wide) reaches threads started afterwards; a trainer that
leaves the EMA worker uncapped is seen in the lerp's thread count.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from pathlib import Path

import pytest
import torch

from cosmos_framework_ext.levers import ema as emamod
from cosmos_framework_ext.recipe import train
from patches.core import threads
from tests.test_train import env, run_main, small_toml  # noqa: F401 - env: the fixture (dataset, output root)


@pytest.fixture
def two_threads():
    """Two intra-op threads by default (the suite runs with ``OMP_NUM_THREADS=1``), so a cap of 1 is told apart."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _job(out: Path) -> Path:
    return out / "cosmos3" / "sft" / "vision_sft_edge_24gb"


def _run(env_dir: Path, monkeypatch, capsys, name: str, setting: str | int) -> dict:
    toml = small_toml(env_dir, **{"cpu_grad_accum_iter     = 1": "cpu_grad_accum_iter     = 2"})
    text = _set(toml.read_text(), json.dumps(setting))
    toml.write_text(text)
    monkeypatch.setenv("OUTPUT_ROOT", str(env_dir / name))
    monkeypatch.setenv("COSMOS_LATENT_CACHE", "1")
    monkeypatch.setenv("COSMOS_EMA_CPU_SUBSET", "1")
    monkeypatch.setenv("ONECARD_LATENT_CACHE", str(env_dir / "latents"))
    rc, _, err = run_main(["--sft-toml", str(toml)], capsys)
    assert rc == 0, err
    return json.loads((_job(env_dir / name) / "summary.json").read_text())


def _set(text: str, literal: str) -> str:
    """The recipe's ``[onecard] background_threads`` set to the TOML ``literal`` (the line replaced, or added)."""
    line = f"background_threads = {literal}"
    out, n = re.subn(r"(?m)^background_threads\s*=.*$", line, text)
    return out if n == 1 else text.replace("[onecard]\n", f"[onecard]\n{line}\n", 1)


def _same_checkpoints(a: dict, b: dict) -> bool:
    """Every tensor of the two runs' last checkpoints equal: ``net.*`` and the EMA's ``net_ema.*``."""
    x = torch.load(a["checkpoint"], map_location="cpu", weights_only=False)["model"]
    y = torch.load(b["checkpoint"], map_location="cpu", weights_only=False)["model"]
    assert any(k.startswith("net_ema.") for k in x)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture
def counts(monkeypatch):
    """The intra-op thread count each loader call and each EMA lerp ran with, and the thread it ran on."""
    seen: dict[str, list[tuple[int, int]]] = {"load": [], "lerp": []}
    real_prefetched, real_lerp = train.prefetched, emamod.CpuSubsetPlacement._host_lerp

    def prefetched(items, load, **kw):
        def counted(item):
            seen["load"].append((torch.get_num_threads(), threading.get_ident()))
            return load(item)
        return real_prefetched(items, counted, **kw)

    def lerp(self, handle, beta):
        seen["lerp"].append((torch.get_num_threads(), threading.get_ident()))
        return real_lerp(self, handle, beta)

    monkeypatch.setattr(train, "prefetched", prefetched)
    monkeypatch.setattr(emamod.CpuSubsetPlacement, "_host_lerp", lerp)
    return seen


def test_capped_background_threads_train_the_same(env, monkeypatch, capsys, counts, two_threads):
    main_before = torch.get_num_threads()
    ref = _run(env, monkeypatch, capsys, "all", "all")
    assert ref["background_threads"] is None
    assert {n for n, _ in counts["load"] + counts["lerp"]} == {main_before}  # uncapped: the default each
    counts["load"].clear(), counts["lerp"].clear()
    capped = _run(env, monkeypatch, capsys, "one", 1)  # a CPU run: "auto" would leave the threads uncapped
    cap = 1
    assert capped["background_threads"] == cap < main_before
    assert counts["load"] and counts["lerp"] and {n for n, _ in counts["load"] + counts["lerp"]} == {cap}
    assert threading.get_ident() not in {t for _, t in counts["load"] + counts["lerp"]}  # background threads only
    assert torch.get_num_threads() == main_before  # the main thread keeps its count
    assert capped["ema"] is not None and ref["ema"] is not None
    assert capped["losses"] == ref["losses"] and _same_checkpoints(capped, ref)


def test_a_capped_thread_changes_no_other_thread(two_threads):
    default = torch.get_num_threads()
    with concurrent.futures.ThreadPoolExecutor(1, initializer=threads.cap_this_thread, initargs=(1,)) as pool:
        assert pool.submit(torch.get_num_threads).result() == 1
        torch.ones(1 << 20).add_(1)  # the main thread runs a parallel operator meanwhile
        assert torch.get_num_threads() == default
        after = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        seen: list[int] = []
        after.start(), after.join()
        assert seen == [default]  # a thread started after the capped one has the default
        assert pool.submit(torch.get_num_threads).result() == 1  # and the capped one keeps its cap


def test_the_cap_is_reported_as_held_or_not():
    got = concurrent.futures.ThreadPoolExecutor(1).submit(lambda: (threads.cap_this_thread(1), torch.get_num_threads()))
    held, n = got.result()
    assert held == (n == 1) and (held or not threads._setters())
    assert threads.cap_this_thread(None) is False
    with pytest.raises(ValueError, match="an integer from 1 to"):
        threads.cap_this_thread(0)


def test_the_host_lerp_gives_the_same_bits_on_one_thread(two_threads):
    g = torch.Generator().manual_seed(0)
    n = 1 << 20  # well above ATen's grain size (32768): split across the team
    shadow = torch.randn(n, generator=g)
    source = torch.randn(n, generator=g).to(torch.bfloat16)
    beta = 0.987654321

    def lerp(cap):
        out = [shadow.clone()]
        place = emamod.CpuSubsetPlacement([source.clone()], pin=False, chunk_numel=1 << 18, threads=cap)
        place.shadow[0].copy_(out[0])
        place.update([source], beta)
        place.synchronize()
        result = place.shadow[0].clone()
        place.close()
        return result

    one, every = lerp(1), lerp(None)
    # the formula apart: ema + (1 - beta) (p - ema), as torch.lerp computes it, in float64 then rounded
    ref = (shadow.double() + (1 - torch.tensor(beta, dtype=torch.float32).double())
           * (source.double() - shadow.double())).float()
    assert torch.equal(one, every)
    assert torch.allclose(one, ref, rtol=0, atol=1e-6)


def test_a_cap_the_runtime_did_not_take_is_reported_as_not_held(monkeypatch, two_threads):
    """``cap_this_thread`` reads the count back: a setter that changed nothing, or no runtime found, is ``False``."""
    def in_a_thread():
        return concurrent.futures.ThreadPoolExecutor(1).submit(lambda: (threads.cap_this_thread(1),
                                                                        torch.get_num_threads())).result()

    monkeypatch.setattr(threads, "_setters", lambda: (lambda n: None,))  # a runtime ATen does not use
    assert in_a_thread() == (False, 2)
    monkeypatch.setattr(threads, "_setters", lambda: ())  # no OpenMP runtime found
    assert in_a_thread() == (False, 2)


def test_the_openmp_runtime_is_found_where_aten_uses_openmp():
    threads._setters.cache_clear()
    found = threads._setters()
    assert bool(found) == ("parallel backend: OpenMP" in torch.__config__.parallel_info())


def _as_on_a_gpu(monkeypatch):
    """The trainer resolves ``"auto"`` as on a GPU run (this CPU run's own threads are not touched otherwise)."""
    real = threads.background_threads
    monkeypatch.setattr(train, "background_threads", lambda setting, busy, gpu: real(setting, busy, gpu=True))


@pytest.mark.parametrize("ema_lever,cap", [("1", 3), ("0", 4)])
def test_the_trainer_counts_the_ema_worker_among_the_busy_threads(env, monkeypatch, capsys, ema_lever, cap):
    monkeypatch.setattr(threads, "cores", lambda: 11)  # "auto": 9 cores for 2 loader threads (+ the EMA's worker)
    monkeypatch.setattr(train, "PREFETCH_DEPTH", 2)
    _as_on_a_gpu(monkeypatch)
    toml = small_toml(env)
    toml.write_text(_set(toml.read_text(), '"auto"'))
    monkeypatch.setenv("COSMOS_EMA_CPU_SUBSET", ema_lever)
    rc, _, err = run_main(["--sft-toml", str(toml), "--max-iter", "1"], capsys)
    assert rc == 0, err
    assert json.loads((_job(env / "out") / "summary.json").read_text())["background_threads"] == cap


@pytest.mark.parametrize("setting,busy,want", [("all", 3, None), (4, 3, 4), (1, 1, 1), (16, 3, 16)])
def test_the_count_each_background_thread_gets(monkeypatch, setting, busy, want):
    monkeypatch.setattr(threads, "cores", lambda: 16)
    assert threads.background_threads(setting, busy) == want


def test_auto_leaves_a_cpu_run_uncapped(env, monkeypatch, capsys):
    assert threads.background_threads("auto", 3, gpu=False) is None
    toml = small_toml(env)
    toml.write_text(_set(toml.read_text(), '"auto"'))
    rc, out, err = run_main(["--sft-toml", str(toml), "--max-iter", "1"], capsys)
    assert rc == 0, err
    assert json.loads((_job(env / "out") / "summary.json").read_text())["background_threads"] is None


def test_the_ledger_refuses_what_the_trainer_refuses(tmp_path, monkeypatch):
    from cosmos_framework_ext.recipe import config as cfgmod, ledger

    monkeypatch.setattr(threads, "cores", lambda: 2)
    recipe = Path(__file__).resolve().parents[2] / "toml" / "vision_sft_edge_24gb.toml"
    toml = tmp_path / "r.toml"
    toml.write_text(_set(recipe.read_text(), "3"))
    with pytest.raises(ValueError, match=r"\[onecard\] background_threads = 3 is not .* a count of at most 2"):
        ledger.cosmos_ledger(cfgmod.load(toml), "tiny", {}, device_type="cpu")


def test_auto_shares_the_cores_less_two(monkeypatch):
    monkeypatch.setattr(threads, "cores", lambda: 16)
    assert threads.background_threads("auto", 3) == 4
    monkeypatch.setattr(threads, "cores", lambda: 2)
    assert threads.background_threads("auto", 3) == 1  # never below one


@pytest.mark.parametrize("setting,busy", [(0, 3), (-2, 3), ("some", 3), (True, 3), (17, 3), (2**31, 3), (4, 0),
                                          (4, 2.5), (4, True)])
def test_a_count_that_means_nothing_is_refused(monkeypatch, setting, busy):
    monkeypatch.setattr(threads, "cores", lambda: 16)
    with pytest.raises(ValueError):
        threads.background_threads(setting, busy)


@pytest.mark.parametrize("n", [0, -1, True, 1.5, "2", 2**31, 10**30])
def test_a_cap_that_is_not_a_count_is_refused_before_any_thread_starts(n):
    with pytest.raises(ValueError, match="an integer from 1 to 2147483647"):
        threads.cap_this_thread(n)
    with pytest.raises(ValueError, match="an integer from 1 to 2147483647"):
        threads.thread_pool(1, "x", n)


def test_the_trainer_refuses_more_threads_than_cores_before_any_work(env, monkeypatch, capsys):
    monkeypatch.setattr(threads, "cores", lambda: 2)
    toml = small_toml(env)
    toml.write_text(_set(toml.read_text(), "3"))
    rc, out, err = run_main(["--sft-toml", str(toml)], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ")
    assert "[onecard] background_threads = 3" in lines[0] and 'set "auto", or a count of at most 2' in lines[0]
    assert not (env / "out").exists()


def test_a_cap_the_runtime_does_not_take_is_dropped_and_said(env, monkeypatch, capsys):
    monkeypatch.setattr(threads, "_setters", lambda: ())  # no OpenMP runtime this process can set
    toml = small_toml(env)
    toml.write_text(_set(toml.read_text(), "1"))
    rc, out, err = run_main(["--sft-toml", str(toml), "--max-iter", "1"], capsys)
    assert rc == 0, err
    assert "background_threads = 1 not applied" in out
    assert json.loads((_job(env / "out") / "summary.json").read_text())["background_threads"] is None


def test_the_upstream_toml_copy_says_upstream_keeps_its_threads(tmp_path, capsys):
    from cosmos_framework_ext.recipe import config as cfgmod

    recipe = Path(__file__).resolve().parents[2] / "toml" / "vision_sft_edge_24gb.toml"
    assert cfgmod._main(["upstream-toml", str(recipe), str(tmp_path / "a.toml")]) == 0
    assert 'background_threads = "auto", which only the embedded trainer reads' in capsys.readouterr().err
    assert "background_threads" not in (tmp_path / "a.toml").read_text()
    src = tmp_path / "all.toml"
    src.write_text(_set(recipe.read_text(), '"all"'))
    assert cfgmod._main(["upstream-toml", str(src), str(tmp_path / "b.toml")]) == 0
    assert "background_threads" not in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- planted
def test_planted_a_process_wide_cap_reaches_later_threads(two_threads):
    default = torch.get_num_threads()

    def process_wide(n):  # the bug: torch.set_num_threads changes the count threads started later begin with
        torch.set_num_threads(n)

    try:
        with concurrent.futures.ThreadPoolExecutor(1, initializer=process_wide, initargs=(1,)) as pool:
            pool.submit(lambda: None).result()
            later = concurrent.futures.ThreadPoolExecutor(1).submit(torch.get_num_threads).result()
        assert later != default  # what test_a_capped_thread_changes_no_other_thread asserts
    finally:
        torch.set_num_threads(default)


def test_planted_an_uncapped_ema_worker_is_seen(env, monkeypatch, capsys, counts, two_threads):
    real = emamod.EMA.__init__

    def uncapped(self, model, **kw):  # the bug: the trainer's count never reaches the EMA
        kw["threads"] = None
        real(self, model, **kw)

    monkeypatch.setattr(emamod.EMA, "__init__", uncapped)
    _run(env, monkeypatch, capsys, "one", 1)
    assert {n for n, _ in counts["lerp"]} != {1}


@pytest.mark.parametrize("value,message", [("0", "must be >= 1"), ("-1", "must be >= 1"),
                                           ('"some"', "expected int or one of ['all', 'auto']"),
                                           ("true", "expected int or one of ['all', 'auto']")])
def test_the_recipe_refuses_a_count_that_means_nothing(tmp_path, value, message):
    from cosmos_framework_ext.recipe import config as cfgmod

    text = (Path(__file__).resolve().parents[2] / "toml" / "vision_sft_edge_24gb.toml").read_text()
    toml = tmp_path / "r.toml"
    toml.write_text(_set(text, value))
    with pytest.raises(cfgmod.ConfigError, match=r"\[onecard\]\.background_threads = .*" + re.escape(message)):
        cfgmod.load(toml)
