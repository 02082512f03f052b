import torch
from kdacp import kernels as kn
from kdacp.bench.kernels import make_inputs
x = make_inputs()
for _ in range(3):
    kn.state_summary(x["kg"], x["w"], x["u"], x["gc"], chunk_size=64, output="both")
torch.cuda.synchronize()
