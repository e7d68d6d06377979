"""Probe: what the frozen text stream costs inside one compiled decoder layer, and what a layer that takes the
text keys/values from a cache (the vision stream only) would cost. Edge dims, random bf16 weights, one packed
micro-batch shaped like the benchmark's near-cap ones (37 samples, 60 text + 270 vision tokens each = 12,210),
variable-length attention, the generation pathway trainable, the text stream detached. Times: median of 20, CUDA
events, forward alone and forward + backward (gradient of the vision output only)."""
import json, os, sys, time
import torch
sys.path.insert(0, os.getcwd())
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3VLTextMoTDecoderLayer
from cosmos_framework_ext.recipe.attention import PackedAttnProcessor, _rotate_half
from cosmos_framework_ext.levers.attention_varlen import VarlenSegments

out_path = sys.argv[1] if len(sys.argv) > 1 else None
dev, dt = torch.device("cuda"), torch.bfloat16
n, tl, vl = 37, 60, 270
torch.manual_seed(0)
layer = Cosmos3VLTextMoTDecoderLayer(hidden_size=2048, head_dim=128, num_attention_heads=16, num_key_value_heads=8,
                                     intermediate_size=9216, attention_bias=False, rms_norm_eps=1e-6, hidden_act="relu2",
                                     qk_norm_for_text=False, use_und_k_norm_for_gen=True).to(dev, dt)
for name, p in layer.named_parameters():
    p.requires_grad_("moe_gen" in name or "add_" in name or "added" in name or "k_norm_und_for_gen" in name)
proc = PackedAttnProcessor()
layer.self_attn.set_processor(proc)
und_seg = torch.arange(n).repeat_interleave(tl)
gen_seg = torch.arange(n).repeat_interleave(vl)
proc.segments = VarlenSegments(und_seg, gen_seg, dev)
U, G = und_seg.numel(), gen_seg.numel()
und = torch.randn(U, 2048, device=dev, dtype=dt)
gen0 = torch.randn(G, 2048, device=dev, dtype=dt)
ang_u = torch.rand(U, 128, device=dev) * 6.28
ang_g = torch.rand(G, 128, device=dev) * 6.28
rot = (ang_u.cos().to(dt), ang_u.sin().to(dt), ang_g.cos().to(dt), ang_g.sin().to(dt))
dout = torch.randn(G, 2048, device=dev, dtype=dt)


def full(und_seq, gen_seq):
    return layer(und_seq, gen_seq, rot)


with torch.no_grad():  # the cache: the text keys after norm_k, before rope; the values
    a = layer.self_attn
    h = layer.input_layernorm(und)
    k_cached = a.norm_k(a.to_k(h).view(-1, 8, 128)).contiguous()
    v_cached = a.to_v(h).view(-1, 8, 128).contiguous()


def gen_only(k_und, v_und, gen_seq):
    a = layer.self_attn
    g = layer.input_layernorm_moe_gen(gen_seq)
    q = a.norm_added_q(a.add_q_proj(g).view(-1, 16, 128))
    k = a.norm_added_k(a.add_k_proj(g).view(-1, 8, 128))
    v = a.add_v_proj(g).view(-1, 8, 128)
    cu, su, cg, sg = (t.unsqueeze(1) for t in rot)
    ku = a.k_norm_und_for_gen(k_und)
    ku = ku * cu + _rotate_half(ku) * su
    q = q * cg + _rotate_half(q) * sg
    k = k * cg + _rotate_half(k) * sg
    o = proc.segments.attend_gen(q, torch.cat([ku, k]), torch.cat([v_und, v]))
    r = gen_seq + a.to_add_out(o)
    return r + layer.mlp_moe_gen(layer.post_attention_layernorm_moe_gen(r))


def timeit(fn, bw, iters=20):
    ms = []
    for i in range(iters + 3):
        gen = gen0.detach().clone().requires_grad_(True)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        with torch.set_grad_enabled(bw):
            out = fn(gen)
            if bw:
                out.backward(dout)
        e.record(); torch.cuda.synchronize()
        if i >= 3:
            ms.append(s.elapsed_time(e))
        for p in layer.parameters():
            p.grad = None
    return sorted(ms)[len(ms) // 2]


res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "samples": n, "text": U, "vision": G}
cf = torch.compile(full, dynamic=False)
cg_ = torch.compile(gen_only, dynamic=False)
variants = {"full layer (text + vision)": lambda g: cf(und, g)[1], "vision only, cached text k/v": lambda g: cg_(k_cached, v_cached, g)}
with torch.no_grad():
    ref = full(und, gen0)[1].float()
    got = gen_only(k_cached, v_cached, gen0).float()
    res["max_rel_diff_eager"] = float((got - ref).abs().max() / ref.abs().max())
for name, fn in variants.items():
    t0 = time.time()
    res[name] = {"fwd_ms": timeit(fn, False), "fwd_bwd_ms": timeit(fn, True), "s": round(time.time() - t0, 1)}
    print(name, res[name], flush=True)
print(json.dumps(res))
if out_path:
    open(out_path, "w").write(json.dumps(res, indent=1))
