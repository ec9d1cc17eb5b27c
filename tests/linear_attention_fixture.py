"""Outputs and gradients of linear_attention before issue 17 (commit 1d43818), float32, for a regression test."""
import torch
from hf_performer import linear_attention, make_feature_map

CASES = [dict(name="favor+", causal=c, masked=mk, kv_heads=kv) for c in (False, True) for mk in (False, True)
         for kv in (4, 2)]
CASES += [dict(name=n, causal=c, masked=True, kv_heads=kv) for n, kv in (("hedgehog", 2), ("relu", 4))
          for c in (False, True)]

def build(case):
    g = torch.Generator().manual_seed(17)
    B, H, L, d = 2, 4, 24, 8
    q = torch.randn(B, H, L, d, generator=g)
    k = torch.randn(B, case["kv_heads"], L, d, generator=g)
    v = torch.randn(B, case["kv_heads"], L, d, generator=g)
    mask = None
    if case["masked"]:
        mask = torch.ones(B, L, dtype=torch.bool); mask[0, -5:] = False; mask[1, :3] = False
    kw = dict(num_heads=H, num_key_value_heads=case["kv_heads"]) if case["name"] == "hedgehog" else {}
    torch.manual_seed(0)
    fm = make_feature_map(case["name"], d, nb_features=16, **kw).eval()
    return q, k, v, mask, fm

if __name__ == "__main__":
    results = []
    for case in CASES:
        q, k, v, mask, fm = build(case)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = linear_attention(q, k, v, fm, causal=case["causal"], key_padding_mask=mask, chunk_size=10)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        grads = {n: p.grad.clone() for n, p in fm.named_parameters()}
        results.append(dict(case=case, out=out.detach(), grad_q=q.grad, grad_k=k.grad, grad_v=v.grad, param_grads=grads))
    torch.save(results, "tests/data/linear_attention_before_issue17.pt")
    print(len(results))
