"""ncu driver (session scratch, not committed): qwen3-30b-a3b forward, megamoe then SonicMoE fixed-k, 3 times each."""
import sys, functools, torch
sys.path.insert(0, "benchmarks")
import sonicmoe_ab as S
from megamoe.bench.gate import experts_fn
from megamoe.bench.problem import make_tokens, make_weights, forward_TH
from megamoe.bench.workloads import WORKLOADS
w = WORKLOADS["qwen3-30b-a3b"]; E = w.one_gpu_experts or w.num_experts; T = w.tokens_per_gpu
dev, dt = torch.device("cuda"), torch.bfloat16
weights = make_weights(w, range(E), dt, dev)
tok = make_tokens(w, T, E, "balanced", dt, torch.Generator(device=dev).manual_seed(1))
inter = weights.w_down_EHI.shape[2]
w1 = (weights.w_gate_up_E2IH.detach().view(E, 2, inter, w.hidden).transpose(1, 2).reshape(E, 2 * inter, w.hidden).contiguous().requires_grad_())
fn = experts_fn("auto")
for i in range(3):
    forward_TH(fn, weights, tok); torch.cuda.synchronize()
    S.sonic_run("fixed-k", False, w1, weights.w_down_EHI, tok); torch.cuda.synchronize()
print("done")
