# GPU microbenchmark (run from the repository root with PYTHONPATH=.; argument: the JSON to write): compiled flex
# attention forward and backward at a cap-size packed micro-batch, per kernel-options setting; each setting run twice.
import json
import sys
import torch
import torch._dynamo
from torch.nn.attention.flex_attention import flex_attention
from cosmos_framework_ext.levers.attention_blocksparse import BlockSparseSegments, _at_lengths

torch.manual_seed(0)
dev = "cuda"
n_samples, und_per, gen_per = 34, 48, 312          # ~12.2k tokens: 1.6k text + 10.6k vision
und = torch.arange(n_samples, device=dev).repeat_interleave(und_per)
gen = torch.arange(n_samples, device=dev).repeat_interleave(gen_per)
segs = BlockSparseSegments(und, gen, n_segments=n_samples)
H, Hkv, D = 16, 8, 128
Lu, Lg = und.numel(), gen.numel()

def mk(L, h):
    return torch.randn(1, h, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True)

cases = {"und": (mk(Lu, H), mk(Lu, Hkv), mk(Lu, Hkv), segs.und_mask),
         "gen": (mk(Lg, H), mk(Lu + Lg, Hkv), mk(Lu + Lg, Hkv), segs.gen_mask)}
OPTS = {
    "default": {},
    "bwd 64/128/128/64 s3 w4": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64, "bwd_num_stages": 3, "bwd_num_warps": 4},
    "bwd 64/64/64/64 s3 w4": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64, "bwd_num_stages": 3, "bwd_num_warps": 4},
    "bwd 32/128/128/32 s3 w4": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32, "bwd_num_stages": 3, "bwd_num_warps": 4},
    "fwd 128/64 s3 w8": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 8},
    "TMA": {"USE_TMA": True},
}
res = {}
ref = {}
for name, extra in OPTS.items():
    opts = {"FORCE_USE_FLEX_ATTENTION": True, **extra}

    def f(q, k, v, m, _o=opts):
        return flex_attention(q, k, v, block_mask=_at_lengths(m, q.shape[-2], k.shape[-2]), enable_gqa=True, kernel_options=_o)

    torch._dynamo.reset()
    cf = torch.compile(f)
    row = {}
    try:
        for case, (q, k, v, m) in cases.items():
            g = torch.randn(1, H, q.shape[-2], D, device=dev, dtype=torch.bfloat16, generator=torch.Generator(dev).manual_seed(1))
            for _ in range(3):
                o = cf(q, k, v, m); grads = torch.autograd.grad(o, (q, k, v), g)
            torch.cuda.synchronize()
            ef, eb = [], []
            for _ in range(10):
                a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                a.record(); o = cf(q, k, v, m); b.record(); grads = torch.autograd.grad(o, (q, k, v), g); c.record()
                torch.cuda.synchronize(); ef.append(a.elapsed_time(b)); eb.append(b.elapsed_time(c))
            ef.sort(); eb.sort()
            outs = (o.detach(),) + tuple(x.detach() for x in grads)
            if name == "default":
                ref[case] = outs
            diffs = [float((x.float() - y.float()).abs().max()) for x, y in zip(outs, ref[case])]
            again = cf(q, k, v, m); g2 = torch.autograd.grad(again, (q, k, v), g)
            repeat = [torch.equal(x, y) for x, y in zip(outs, (again.detach(),) + tuple(x.detach() for x in g2))]
            row[case] = {"fwd_ms": ef[5], "bwd_ms": eb[5], "maxdiff_o_dq_dk_dv_vs_default": diffs, "repeatable": repeat}
    except Exception as e:  # a config the kernel refuses
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    res[name] = row
    print(name, json.dumps(row), flush=True)
json.dump({"Lu": Lu, "Lg": Lg, "results": res}, open(sys.argv[1], "w"), indent=1)
