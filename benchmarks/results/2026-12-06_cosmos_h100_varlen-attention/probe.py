"""Probe: flex (the lever's compiled call) vs FlashAttention-2 varlen (aten._flash_attention_forward) for one
packed micro-batch's two attention calls; fwd and fwd+bwd time; errors of both against an fp32 per-sample reference."""
import json, sys, time, os
import torch
import torch.nn.functional as F
sys.path.insert(0, os.getcwd())
from benchmarks.flex_kernels import layout
from cosmos_framework_ext.levers import attention_blocksparse as ab

tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 12288
out_path = sys.argv[2] if len(sys.argv) > 2 else None
dev = torch.device("cuda")
text, vision = layout(tokens)
n = len(text)
und = torch.cat([torch.full((t,), i) for i, t in enumerate(text)]).to(dev)
gen = torch.cat([torch.full((v,), i) for i, v in enumerate(vision)]).to(dev)
seg = ab.BlockSparseSegments(und, gen, n_segments=n)
U, G, H, HKV, D = und.numel(), gen.numel(), 16, 8, 128
g = torch.Generator(device=dev).manual_seed(0)
mk = lambda L, h: torch.randn(L, h, D, device=dev, dtype=torch.bfloat16, generator=g)
qu, ku, vu, qg, kg, vg = mk(U, H), mk(U, HKV), mk(U, HKV), mk(G, H), mk(G, HKV), mk(G, HKV)
dou, dog = mk(U, H).flatten(1), mk(G, H).flatten(1)
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "samples": n, "text": U, "vision": G}
print(res, flush=True)

# varlen layout: keys of sample i = [text_i ; vision_i], interleaved
tl, vl = torch.tensor(text), torch.tensor(vision)
cu_u = torch.zeros(n + 1, dtype=torch.int32); cu_u[1:] = tl.cumsum(0)
cu_g = torch.zeros(n + 1, dtype=torch.int32); cu_g[1:] = vl.cumsum(0)
cu_k = torch.zeros(n + 1, dtype=torch.int32); cu_k[1:] = (tl + vl).cumsum(0)
perm = torch.cat([torch.cat([torch.arange(cu_u[i], cu_u[i + 1]), U + torch.arange(cu_g[i], cu_g[i + 1])]) for i in range(n)]).to(dev)
cu_u, cu_g, cu_k = cu_u.to(dev), cu_g.to(dev), cu_k.to(dev)
mu, mg, mkk = int(tl.max()), int(vl.max()), int((tl + vl).max())

def flex_both(a, b, c, d, e, f):
    ou = seg.attend_und(a, b, c)
    og = seg.attend_gen(d, torch.cat([b, e]), torch.cat([c, f]))
    return ou, og

gqa_ok = True
def fa(q, k, v, cq, ck, mq, mk_, causal):
    global gqa_ok
    if not gqa_ok:
        k = k.repeat_interleave(H // HKV, dim=1); v = v.repeat_interleave(H // HKV, dim=1)
    return torch.ops.aten._flash_attention_forward(q, k, v, cq, ck, mq, mk_, 0.0, causal, False)[0]

def varlen_both(a, b, c, d, e, f):
    ou = fa(a, b, c, cu_u, cu_u, mu, mu, True)
    kk, vv = torch.cat([b, e])[perm], torch.cat([c, f])[perm]
    og = fa(d, kk, vv, cu_g, cu_k, mg, mkk, False)
    return ou.flatten(1), og.flatten(1)

def ref_both(a, b, c, d, e, f):
    a, b, c, d, e, f = (t.double() for t in (a, b, c, d, e, f))
    ous, ogs = [], []
    for i in range(n):
        su, sg = slice(int(cu_u[i]), int(cu_u[i + 1])), slice(int(cu_g[i]), int(cu_g[i + 1]))
        q, k, v = (t[s].transpose(0, 1) for t, s in ((a, su), (b, su), (c, su)))
        k, v = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
        ous.append(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).flatten(1))
        q = d[sg].transpose(0, 1)
        k = torch.cat([b[su], e[sg]]).transpose(0, 1).repeat_interleave(2, 0)
        v = torch.cat([c[su], f[sg]]).transpose(0, 1).repeat_interleave(2, 0)
        ogs.append(F.scaled_dot_product_attention(q, k, v).transpose(0, 1).flatten(1))
    return torch.cat(ous), torch.cat(ogs)

def grads(fn):
    leaves = [t.detach().clone().requires_grad_(True) for t in (qu, ku, vu, qg, kg, vg)]
    ou, og = fn(*leaves)
    torch.autograd.backward([ou, og], [dou.to(ou.dtype), dog.to(og.dtype)])
    return [ou.detach().double(), og.detach().double()] + [l.grad.double() for l in leaves]

def timeit(fn, bw, iters=20):
    leaves = [t.detach().clone().requires_grad_(True) for t in (qu, ku, vu, qg, kg, vg)]
    ms = []
    for i in range(iters + 2):
        for l in leaves: l.grad = None
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        ou, og = fn(*leaves)
        if bw:
            torch.autograd.backward([ou, og], [dou, dog])
        e.record(); torch.cuda.synchronize()
        if i >= 2: ms.append(s.elapsed_time(e))
    return sorted(ms)[len(ms) // 2]

try:
    grads(varlen_both)
except Exception as ex:
    print("GQA varlen failed:", repr(ex)[:300]); gqa_ok = False
res["gqa_native"] = gqa_ok
ref = grads(ref_both)
names = ["out_text", "out_vision", "dq_text", "dk_text", "dv_text", "dq_vision", "dk_vision", "dv_vision"]
for name, fn in (("flex", flex_both), ("varlen", varlen_both)):
    t0 = time.time()
    vals = grads(fn)
    err = {k: float((v - r).abs().max() / r.abs().max()) for k, v, r in zip(names, vals, ref)}
    res[name] = {"fwd_ms": timeit(fn, False), "fwd_bwd_ms": timeit(fn, True), "max_rel_err_vs_fp64": err, "s": round(time.time() - t0, 1)}
    print(name, json.dumps(res[name]), flush=True)
vals_f, vals_v = grads(flex_both), grads(varlen_both)
res["varlen_vs_flex"] = {k: float((a - b).abs().max() / b.abs().max()) for k, a, b in zip(names, vals_v, vals_f)}
print(json.dumps(res["varlen_vs_flex"]))
if out_path:
    open(out_path, "w").write(json.dumps(res, indent=1))
