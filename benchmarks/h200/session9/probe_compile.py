import torch
from nano_sparsespec import verifier as vf
from nano_sparsespec.config import SamplingParams
dev = "cuda"
V = 49152
def st_for(B, temp):
    return vf.SamplingTensors.from_params([SamplingParams(temperature=temp)] * B, list(range(B)), dev)
cases = []
for temp in (0.6, 0.0):
    for B in (128, 17, 1):
        cases.append(("drafts", temp, B, 0))
        for K in (0, 8):
            cases.append(("verify", temp, B, K))
for name, temp, B, K in cases:
    torch._dynamo.reset()
    st = st_for(B, temp)
    pos = torch.arange(B, device=dev)
    try:
        if name == "drafts":
            f = torch.compile(vf._sample_drafts, dynamic=True)
            f(torch.randn(B, V, device=dev), st, pos)
        else:
            f = torch.compile(vf._verify_logits, dynamic=True)
            q = None if temp == 0 else torch.softmax(torch.randn(B, K, V, device=dev), -1)
            f(torch.randn(B, K + 1, V, device=dev), torch.randint(0, V, (B, K), device=dev), q,
              torch.full((B,), K, device=dev), st, pos)
        print("ok  ", name, temp, B, K, flush=True)
    except Exception as e:
        print("FAIL", name, temp, B, K, type(e).__name__, str(e).splitlines()[0][:150], flush=True)
