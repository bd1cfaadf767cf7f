"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's experts.

Per token: router logits (x . w_e for each of the E experts) -> softmax -> the top k
probabilities (ties to the lower expert id, as torch.topk) -> renormalised to sum to 1
when ``norm_topk_prob`` (Mixtral always) -> the chosen experts' SwiGLU MLPs, each output
times its weight, summed in ascending expert order (transformers' order).

The step's tokens are grouped by expert: each expert some token chose runs once, on all
its tokens (so for prefill its weights are read once per step, not once per token), and
an expert no token chose is not read at all. Every expert's projections are
compute.models.decoder.Projection objects, so a GGUF file's experts stay in their blocks on the
CPU kernels, in either numerics (--weights quantized / quantized-int8).

Two implementations: on the CPU kernels (``native``) the router is one kernel call
(kernels/csrc/cpu/moe.cpp) and, when every expert is in one block format (``table``),
router and experts are one call, the code hr_decoder_layers runs for a MoE layer (so the
per-op and the fused paths give the same bits); otherwise torch (the reference: the
router below, the experts grouped here).

Batch invariance: a token's router logits are each one reduction over the hidden size
in a fixed order (torch: a broadcast multiply and sum, not a matmul whose blocking
depends on the row count; the kernel: one fixed-order dot product), softmax and top-k are
per row, the quantized kernels compute each row alone
(kernels/csrc/cpu/quant_linear.cpp), and each token's sum over its experts runs in expert
order: the same token gives the same bits alone, in any batch, chunked or whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cpu.elementwise import silu_mul
from kernels.cpu.moe import moe, moe_route, moe_table
from kernels.cpu.quant import QuantizedWeight

# Router rows per broadcast-and-sum chunk (bounds its [rows, E, H] temporary).
_ROUTER_CHUNK = 16


@dataclass
class Expert:
    gate_up: object  # compute.models.decoder.Projection [2 I, H]
    down: object  # compute.models.decoder.Projection [H, I]


class MoE:
    """One layer's mixture-of-experts MLP."""

    def __init__(
        self, router: torch.Tensor | QuantizedWeight, experts: list[Expert], top_k: int,
        normalize: bool, native: bool,
    ) -> None:  # fmt: skip
        """router: [E, H] (a quantized one is dequantized: it is small and read by every
        token); experts: E of them, in id order."""
        if isinstance(router, QuantizedWeight):
            router = router.dequantize()
        self.router = router.contiguous()
        self.experts = experts
        self.top_k, self.normalize, self.native = top_k, normalize, native
        # Experts run so far, each once per step it was chosen in (expert_runs): counted by
        # the kernels into `runs`, by the per-op loop below into `_loop_runs`.
        self.runs = torch.zeros(1, dtype=torch.int64)
        self._loop_runs = 0
        # Every expert in one kernel call per step (kernels/csrc/cpu/moe.cpp), when each
        # projection is one block format; else (dense weights, stacked formats) per op.
        self.table = moe_table(experts) if native else None
        self.int8 = bool(experts and experts[0].gate_up.int8)
        self.inter = 0
        if self.table is not None:
            self.inter = experts[0].down.quantized.cols

    @property
    def expert_runs(self) -> int:
        """Experts run so far, each once per step it was chosen in."""
        return self._loop_runs + int(self.runs[0])

    def route(self, x: torch.Tensor, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k] int64) of each token."""
        if self.native:
            return moe_route(self.router, x, self.top_k, self.normalize, check)
        w = self.router
        logits = torch.cat(
            [
                (x[i : i + _ROUTER_CHUNK, None, :] * w).sum(-1)
                for i in range(0, x.shape[0], _ROUTER_CHUNK)
            ]
        ) if x.shape[0] else x.new_zeros(0, w.shape[0])  # fmt: skip
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), ids

    def __call__(self, x: torch.Tensor, check: bool = True) -> torch.Tensor:
        """x [T, H] (the normed hidden states) -> the MLP's output [T, H]."""
        if self.table is not None:
            return moe(
                self.router, self.table, self.int8, x, self.top_k, self.normalize, self.inter,
                self.runs, check,
            )  # fmt: skip
        weights, ids = self.route(x, check)
        out = torch.zeros_like(x)
        # Tokens grouped by expert, in ascending expert order (a stable sort keeps each
        # expert's tokens in batch order).
        flat = ids.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            picks = order[start : start + count]
            rows = tokens[start : start + count]
            start += count
            self._loop_runs += 1
            y = self._expert(self.experts[e], x.index_select(0, rows), check)
            y.mul_(weights.reshape(-1).index_select(0, picks).unsqueeze(1))
            out.index_add_(0, rows, y)
        return out

    def _expert(self, expert: Expert, x: torch.Tensor, check: bool) -> torch.Tensor:
        gate_up = expert.gate_up(x, check)
        if self.native:
            return expert.down(silu_mul(gate_up, check), check)
        gate, up = gate_up.chunk(2, dim=-1)
        return expert.down(F.silu(gate) * up)

    @property
    def nbytes(self) -> int:
        """Bytes of every expert's weights (the router excluded)."""
        total = 0
        for expert in self.experts:
            for p in (expert.gate_up, expert.down):
                total += p.quantized.nbytes if p.quantized is not None else p.weight.nbytes
        return total
