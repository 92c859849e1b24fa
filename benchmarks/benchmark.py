"""`kernels benchmark` entry point (the kernels.Benchmark convention): `kernels benchmark . ` from a
clone on a CUDA machine, or `kernels benchmark trl-lib/fused-linear-ce@v1`.

Workloads: the forward (loss and metrics, no grad) and the forward + backward of the Llama-3 lm-head
shape on CUDA (a tiny shape elsewhere), each verified against plain torch with fp32 logits.
"""

import torch
import torch.nn.functional as F
from kernels.benchmark import Benchmark


class FusedLinearCrossEntropyBenchmark(Benchmark):
    seed = 0

    def setup(self):
        big = self.device == "cuda"
        n, h, v = (4096, 4096, 128256) if big else (64, 64, 512)
        dtype = torch.bfloat16 if big else torch.float32
        g = torch.Generator(device=self.device).manual_seed(0)
        self.hidden = torch.randn(n, h, device=self.device, generator=g).to(dtype)
        self.weight = (torch.randn(v, h, device=self.device, generator=g) / h**0.5).to(dtype)
        self.targets = torch.randint(0, v, (n,), device=self.device, generator=g)

    def _reference(self):
        return F.cross_entropy((self.hidden @ self.weight.T).float(), self.targets)

    def benchmark_forward(self):
        with torch.no_grad():
            self.out = self.kernel.fused_linear_cross_entropy(self.hidden, self.weight, self.targets)

    def verify_forward(self):
        return self._reference()

    def benchmark_forward_backward(self):
        w = self.weight.detach().requires_grad_(True)
        loss = self.kernel.fused_linear_cross_entropy(self.hidden, w, self.targets)
        loss.backward()
        self.out = loss.detach()

    def verify_forward_backward(self):
        return self._reference()
