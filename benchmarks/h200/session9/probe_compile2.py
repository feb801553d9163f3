import torch
from nano_sparsespec import verifier as vf
from nano_sparsespec.config import SamplingParams
dev, V, B = "cuda", 49152, 128
st = vf.SamplingTensors.from_params([SamplingParams(temperature=0.6)] * B, list(range(B)), dev)
logits = torch.randn(B, V, device=dev)
probs = vf.probs_from_logits(logits, st)
u = torch.rand(B, device=dev)
pos = torch.arange(B, device=dev)
def cdf_only(p):
    return p.cumsum(-1)
def search(p, u):
    cdf = p.cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
def softmax_cumsum(x):
    return (x / 0.6).softmax(-1).cumsum(-1)
cases = {"probs": (vf.probs_from_logits, (logits, st)), "inverse_cdf": (vf._inverse_cdf, (probs, u)),
         "cumsum": (cdf_only, (probs,)), "search": (search, (probs, u)), "softmax_cumsum": (softmax_cumsum, (logits,)),
         "uniform": (vf.uniform, (st.seed, pos, 1))}
for name, (fn, args) in cases.items():
    for dyn in (True, False):
        torch._dynamo.reset()
        try:
            torch.compile(fn, dynamic=dyn)(*args)
            print("ok  ", name, dyn, flush=True)
        except Exception as e:
            print("FAIL", name, dyn, type(e).__name__, str(e).splitlines()[0][:120], flush=True)
