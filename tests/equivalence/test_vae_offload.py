"""A/B equivalence of lever 2 (``COSMOS_VAE_CPU_OFFLOAD``): the parked-in-pinned-memory Wan2.2 VAE.

Proof: latents from the resident VAE and from the same VAE after attaching :class:`VAEOffload` and
cycling it through ``on_device()`` (the one way to the device) are ``torch.equal``; the state_dict (dtype, shape, stride, value per tensor) and the
buffer set are unchanged. Planted bugs show the proof can fail: a host copy in the wrong dtype, and an
unpark that allocates without copying. CPU tests use the ``tiny`` preset (Wan2.2 layout, base_dim 8) and
a 1x3x9x32x32 float32 clip; the CUDA test runs the same proof on the GPU. Since the A/B compares the encoder
with itself, an independent anchor pins ``encode_latents`` to diffusers' posterior ``mode()`` normalised with
Wan2.2's statistics (a posterior sample, or another normalisation, fails it).
"""

from __future__ import annotations

import gc
import os

import psutil
import pytest
import torch
from torch import nn

from cosmos_framework_ext.levers import vae_offload as vo
from cosmos_framework_ext.recipe.presets import build_vae, get_preset
from cosmos_framework_ext.levers.vae_offload import VAEOffload
from cosmos_framework_ext.recipe.vae import encode_latents
from tests.equivalence.vae_checks import check_equivalence, measure_round_trip
from patches.core.host_arena import HostArena

MiB = 2**20


def _tiny_vae(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return build_vae(get_preset("tiny"), device=device)


def _clip(device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return (torch.rand(1, 3, 9, 32, 32, generator=g) * 2 - 1).to(device)


def _add_probe_buffers(vae: nn.Module) -> None:
    """The Wan VAE registers no buffers at all; add some so buffer handling is really exercised.

    Covers: persistent and non-persistent buffers, mixed dtypes (fp64, int64, bf16 in an fp32 model),
    one tensor registered in two modules (must stay shared), buffers in the resident encoder and in the
    parked decoder, a non-contiguous (channels_last_3d) parameter, and an fp16 submodule.
    """
    vae.post_quant_conv.to(torch.float16)  # never used by encode; dtype must survive the round trip
    g = torch.Generator().manual_seed(2)
    shared = torch.randn(5, generator=g, dtype=torch.float64)
    vae.decoder.register_buffer("probe_shared", shared)
    vae.post_quant_conv.register_buffer("probe_shared", shared)
    vae.decoder.register_buffer("probe_steps", torch.arange(7, dtype=torch.int64), persistent=False)
    vae.decoder.register_buffer("probe_bf16", torch.randn(3, 4, generator=g).to(torch.bfloat16))
    vae.encoder.register_buffer("probe_enc", torch.randn(6, generator=g))
    w = vae.decoder.conv_in.weight
    w.data = w.data.to(memory_format=torch.channels_last_3d)
    assert vae.decoder.probe_shared is vae.post_quant_conv.probe_shared


# ---------------------------------------------------------------------------------------------- A/B


@pytest.mark.parametrize("keep_encoder_resident", [False, True])
def test_latents_equal_resident_vs_offloaded(keep_encoder_resident: bool) -> None:
    vae = _tiny_vae()
    video = _clip()
    ref = encode_latents(vae, video)
    assert ref.shape == (1, 48, 3, 2, 2) and ref.dtype == torch.float32

    off = VAEOffload(vae, "cpu", keep_encoder_resident=keep_encoder_resident)
    assert vae._onecard_offload is off and off.parked
    for _ in range(3):
        with off.on_device():
            pass
    with off.on_device():
        out = encode_latents(vae, video)
    assert torch.equal(out, ref)
    # Parked again; standalone encode_latents moves for the call only (or not at all when resident).
    assert off.parked
    assert torch.equal(encode_latents(vae, video), ref)
    assert off.parked


@pytest.mark.parametrize("keep_encoder_resident", [False, True])
def test_check_equivalence_passes_with_buffers_and_dtypes(keep_encoder_resident: bool) -> None:
    vae = _tiny_vae()
    _add_probe_buffers(vae)
    report = check_equivalence(vae, _clip(), "cpu", keep_encoder_resident=keep_encoder_resident, cycles=3)
    assert report.ok, report
    assert report.max_abs_diff == 0.0
    assert getattr(vae, "_onecard_offload", None) is None  # check_equivalence removes its offload


def test_state_dtypes_buffers_and_parameter_objects_preserved() -> None:
    vae = _tiny_vae()
    _add_probe_buffers(vae)
    sd0 = {k: v.clone() for k, v in vae.state_dict().items()}
    layout0 = {k: (v.dtype, v.shape, v.stride()) for k, v in vae.state_dict().items()}
    bufs0 = {k: v.clone() for k, v in vae.named_buffers()}
    params0 = {k: (id(p), p.requires_grad) for k, p in vae.named_parameters()}

    off = VAEOffload(vae, "cpu")

    def check() -> None:
        sd = vae.state_dict()
        assert {k: (v.dtype, v.shape, v.stride()) for k, v in sd.items()} == layout0
        assert all(torch.equal(sd[k], v) for k, v in sd0.items())
        bufs = dict(vae.named_buffers())
        assert bufs.keys() == bufs0.keys()
        assert all(bufs[k].dtype == v.dtype and torch.equal(bufs[k], v) for k, v in bufs0.items())
        assert vae.decoder.probe_shared is vae.post_quant_conv.probe_shared  # still one shared tensor
        assert {k: (id(p), p.requires_grad) for k, p in vae.named_parameters()} == params0

    for _ in range(4):
        check()  # parked
        with off.on_device():
            check()  # unparked
    check()
    # named_buffers() lists the shared buffer once; the offload also stores it once.
    assert off.num_tensors == len(params0) + len(bufs0) == len(params0) + 4


def test_storage_really_moves() -> None:
    vae = _tiny_vae()
    off = VAEOffload(vae, "cpu")
    params = list(vae.parameters())
    assert params and all(off.in_arena(p) for p in params)  # parked: the data IS the host copy
    host_ptrs = [p.data_ptr() for p in params]
    with off.on_device():
        assert not any(off.in_arena(p) for p in params)  # fresh storage, outside the arena
    assert [p.data_ptr() for p in params] == host_ptrs  # back to the same host copies
    assert off.host_bytes >= off.device_bytes_when_unparked == sum(p.numel() * p.element_size() for p in params)


def test_keep_encoder_resident_parks_only_the_decoder_side() -> None:
    vae = _tiny_vae()
    off = VAEOffload(vae, "cpu", keep_encoder_resident=True)
    assert off.resident_attrs == ("encoder", "quant_conv")
    resident = [*vae.encoder.parameters(), *vae.quant_conv.parameters()]
    parked = [*vae.decoder.parameters(), *vae.post_quant_conv.parameters()]
    assert all(off.in_arena(p) for p in parked) and not any(off.in_arena(p) for p in resident)
    ptrs = [p.data_ptr() for p in resident]
    encode_latents(vae, _clip())  # encode path resident: no unpark needed
    with off.on_device(encode_only=True):  # nor for an encode-only block
        assert all(off.in_arena(p) for p in parked) and off.depth == 0
    assert off.stats["unpark_count"] == 0
    with off.on_device():
        assert not any(off.in_arena(p) for p in parked)
    assert [p.data_ptr() for p in resident] == ptrs  # never moved


def test_host_rss_flat_over_cycles() -> None:
    """20 park/unpark cycles leave host RSS flat.

    Slack 16 MiB: on the CPU device each unpark allocates fresh copies (3.2 MB for the tiny VAE) and park
    frees them; glibc may keep freed chunks in its heap or arenas instead of returning them, and RSS
    moves by whole pages, so a few MiB of allocator noise is expected. A leak of one copy per cycle would
    be 20 x 3.2 MB = 61 MiB, far above the slack (asserted below, so the test keeps its power).
    """
    vae = _tiny_vae()
    off = VAEOffload(vae, "cpu")
    slack = 16 * MiB
    assert 20 * off.device_bytes_when_unparked > 2 * slack
    proc = psutil.Process(os.getpid())
    for _ in range(3):  # warm the allocator
        with off.on_device():
            pass
    gc.collect()
    before = proc.memory_info().rss
    for _ in range(20):
        with off.on_device():
            pass
    gc.collect()
    after = proc.memory_info().rss
    assert after - before < slack, f"RSS grew by {(after - before) / MiB:.1f} MiB over 20 cycles"


def test_context_manager_parks_on_exception_and_does_not_double_move() -> None:
    vae = _tiny_vae()
    off = VAEOffload(vae, "cpu")
    with pytest.raises(RuntimeError, match="boom"):
        with off.on_device():
            assert not off.parked
            raise RuntimeError("boom")
    assert off.parked and all(off.in_arena(p) for p in vae.parameters())

    assert off.depth == 0
    with off.on_device():
        with off.on_device():  # nested: no move
            assert off.depth == 2
            for _ in range(3):
                encode_latents(vae, _clip())  # nested again inside encode_latents
        assert not off.parked and off.depth == 1  # the inner exit did not park
    assert off.parked and off.depth == 0
    assert (off.stats["unpark_count"], off.stats["park_count"]) == (2, 2)

    # an exception in a nested block unwinds every level and parks exactly once
    with pytest.raises(RuntimeError, match="inner"):
        with off.on_device():
            with off.on_device():
                raise RuntimeError("inner")
    assert off.parked and off.depth == 0
    assert (off.stats["unpark_count"], off.stats["park_count"]) == (3, 3)
    # park and unpark are not public: on_device() is the one way in
    assert not hasattr(off, "park") and not hasattr(off, "unpark") and not hasattr(off, "for_encode")


def test_trainable_parameter_raises() -> None:
    vae = _tiny_vae()
    vae.decoder.conv_out.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"requires_grad_\(False\)"):
        VAEOffload(vae, "cpu")
    assert getattr(vae, "_onecard_offload", None) is None


def test_second_offload_and_bad_encoder_attr_raise() -> None:
    vae = _tiny_vae()
    with pytest.raises(ValueError, match="no submodule 'enc'"):
        VAEOffload(vae, "cpu", keep_encoder_resident=True, encoder_attr="enc")
    off = VAEOffload(vae, "cpu")
    with pytest.raises(ValueError, match="already has a VAEOffload"):
        VAEOffload(vae, "cpu")
    with off.on_device(), pytest.raises(RuntimeError, match="inside on_device"):
        off.remove()
    off.remove()
    assert getattr(vae, "_onecard_offload", None) is None and not any(off.in_arena(p) for p in vae.parameters())


def test_encode_latents_rejects_bad_clips() -> None:
    vae = _tiny_vae()
    with pytest.raises(ValueError, match="4n \\+ 1"):
        encode_latents(vae, torch.zeros(1, 3, 10, 32, 32))  # Wan would silently drop frame 9
    with pytest.raises(ValueError, match="multiples of 16"):
        encode_latents(vae, torch.zeros(1, 3, 9, 24, 32))
    with pytest.raises(ValueError, match=r"\[B, 3, T, H, W\]"):
        encode_latents(vae, torch.zeros(3, 9, 32, 32))


def test_measure_round_trip_and_stats() -> None:
    vae = _tiny_vae()
    off = VAEOffload(vae, "cpu")
    res = measure_round_trip(off, n=5)
    assert res["n"] == 5 and 0 < res["min_s"] <= res["median_s"] <= res["max_s"]
    assert res["bytes"] == off.device_bytes_when_unparked
    assert off.parked  # left as found
    s = off.stats
    assert s["unpark_count"] == s["park_count"] == 6 and s["unpark_seconds"] > 0 and s["park_seconds"] > 0
    assert s["pinned_bytes"] == 0 and s["host_bytes"] == off.arena.nbytes  # no pinning for a CPU device


def test_offload_from_env() -> None:
    vae = _tiny_vae()
    assert vo.offload_from_env(vae, "cpu", environ={}) is None
    off = vo.offload_from_env(vae, "cpu", environ={"COSMOS_VAE_CPU_OFFLOAD": "1"})
    assert isinstance(off, VAEOffload) and vo.get_offload(vae) is off


# ----------------------------------------------------------------------------------- independent anchor


def test_encode_is_the_normalised_posterior_mean() -> None:
    """The A/B above compares the encoder with itself; this pins it to upstream's rule with diffusers' own
    posterior: ``(mode() - latents_mean) / latents_std`` (the mean, no sampling; Wan2.2's 48-channel stats)."""
    vae = _tiny_vae()
    video = _clip()
    assert list(vae.config.latents_mean[:3]) == [-0.2289, -0.0052, -0.1323]  # upstream's Wan2.2 values
    assert list(vae.config.latents_std[:3]) == [0.4765, 1.0364, 0.4514]
    with torch.no_grad():
        posterior = vae.encode(video).latent_dist
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    want = (posterior.mode() - mean) / std
    torch.testing.assert_close(encode_latents(vae, video), want, rtol=1e-5, atol=1e-6)
    # the anchor has power: a posterior sample (any seed) is far from the mean on this VAE
    sample = (posterior.sample(torch.Generator().manual_seed(0)) - mean) / std
    assert not torch.allclose(sample, want, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------- planted bugs


def _bf16_host_arena(specs, pin=True, name="arena"):  # noqa: ANN001 - mirrors HostArena's signature
    """PLANTED BUG: a host arena that stores fp32 tensors as bf16."""
    return HostArena([(s, torch.bfloat16 if d == torch.float32 else d) for s, d in specs], pin=pin, name=name)


class _UpcastOnUnpark(VAEOffload):
    """With the bf16 arena: unpark casts back to fp32, so only the values (not the dtype) betray the bug."""

    def _device_copy(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, torch.float32 if host.dtype == torch.bfloat16 else host.dtype, copy=True)


class _NoCopyUnpark(VAEOffload):
    """PLANTED BUG: unpark allocates device storage but never copies the host data into it."""

    def _device_copy(self, host: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)


@pytest.mark.parametrize("factory", [VAEOffload, _UpcastOnUnpark], ids=["dtype-leaks", "upcast-hides-dtype"])
def test_planted_bug_host_copy_in_bf16_fails_the_proof(monkeypatch: pytest.MonkeyPatch, factory: type) -> None:
    monkeypatch.setattr(vo, "HostArena", _bf16_host_arena)
    vae = _tiny_vae()
    report = check_equivalence(vae, _clip(), "cpu", offload_factory=factory)
    assert not report.latents_equal
    assert not report.state_equal_parked and not report.state_equal_unparked
    assert not report.ok
    # Not an artefact of NaNs: the bf16 rounding error itself is what the proof caught.
    assert 0.0 < report.max_abs_diff < float("inf")


def test_planted_bug_unpark_without_copy_fails_the_proof() -> None:
    vae = _tiny_vae()
    report = check_equivalence(vae, _clip(), "cpu", offload_factory=_NoCopyUnpark)
    assert not report.latents_equal and not report.state_equal_unparked and not report.ok
    # The snapshot was loaded back: the vae still encodes like the original.
    assert torch.equal(encode_latents(vae, _clip()), encode_latents(_tiny_vae(), _clip()))


# ------------------------------------------------------------------------------------------------ CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: GPU equality and pinned-memory transfers")
@pytest.mark.parametrize("keep_encoder_resident", [False, True])
def test_cuda_equivalence_and_pinned_transfers(keep_encoder_resident: bool) -> None:
    vae = _tiny_vae("cuda")
    video = _clip("cuda")
    report = check_equivalence(vae, video, "cuda", keep_encoder_resident=keep_encoder_resident)
    assert report.ok, report

    ref = encode_latents(vae, video)
    off = VAEOffload(vae, "cuda", keep_encoder_resident=keep_encoder_resident)
    assert off.device == torch.device("cuda", torch.cuda.current_device())
    # The host copies are page-locked at their exact size (cudaHostRegister), and are what the module holds.
    assert off.pinned_bytes == off.host_bytes > 0
    assert all(h.is_pinned() for h in off.host_tensors())
    parked = [p for p in vae.parameters() if off.in_arena(p)]
    assert parked and all(p.device.type == "cpu" for p in parked)

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with off.on_device():
            grown = torch.cuda.memory_allocated() - base
    assert grown >= off.device_bytes_when_unparked
    assert torch.cuda.memory_allocated() == base  # park dropped the device storage
    copies = [e.name for e in prof.events() if "HtoD" in e.name]
    if copies:  # CUPTI present: every H2D copy must come from pinned memory, none staged through pageable
        assert all("Pinned" in n for n in copies) and not any("Pageable" in n for n in copies), copies

    with off.on_device():
        assert all(p.device.type == "cuda" for p in vae.parameters())
        out = encode_latents(vae, video)
    assert torch.equal(out, ref)
    assert all(p.device.type == "cpu" for p in parked)
    rt = measure_round_trip(off, n=3)
    assert rt["median_s"] > 0


# ------------------------------------------------------------------------- the upstream adapter (CPU)


def test_upstream_offload_moves_the_scale_with_the_module_under_one_counter() -> None:
    """``UpstreamVaeOffload`` is a :class:`VAEOffload` whose moves also carry upstream's ``wan.scale`` tuple."""
    from types import SimpleNamespace

    from cosmos_framework_ext.upstream.patches import UpstreamVaeOffload

    vae = _tiny_vae()
    scale = (torch.randn(48), torch.rand(48) + 0.5)
    wan = SimpleNamespace(model=vae, scale=scale)
    ref = encode_latents(vae, _clip())
    off = UpstreamVaeOffload(wan, torch.device("cpu"))
    assert isinstance(off, VAEOffload) and vo.get_offload(vae) is off
    assert off.parked and wan.scale is off._host_scale
    assert all(torch.equal(a, b) for a, b in zip(wan.scale, scale))
    with off.on_device():
        on_device_scale = wan.scale
        assert on_device_scale is not off._host_scale
        with off.on_device():  # nested (get_data_and_condition -> encode): nothing moves again
            assert wan.scale is on_device_scale
            out = encode_latents(vae, _clip())
    assert off.parked and wan.scale is off._host_scale and off.depth == 0
    assert (off.stats["unpark_count"], off.stats["park_count"]) == (1, 1)
    assert torch.equal(out, ref)
