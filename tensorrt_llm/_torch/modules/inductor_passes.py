"""How the layer regions are compiled (`compiled_regions`, `models/dspark_regions`): inductor with a
dynamic token count and one graph pass of our own.

Inductor folds a residual add into the GEMM before it (`h + x @ w.T` -> `addmm(h, x, w.T)`). With a
full [T, N] residual, ATen's CUDA addmm first copies h into its output (a `Memcpy DtoD` at T > 1, a
cuBLAS copy kernel at T = 1) and then runs the GEMM with beta = 1: one launch more per residual add,
two per decoder layer (o_proj and down_proj), in every step. `ResidualMatmulPass` runs after
inductor's own post-grad patterns and turns such an addmm back into mm + add where the sum feeds
more work of the region, so the add fuses into the kernel after it (the next RMSNorm's, which
stores the residual stream anyway). An addmm whose sum is only the region's output keeps it (the
add would be a kernel of its own), and so does a broadcast bias (an [N] row: cuBLASLt adds it in
the GEMM's epilogue, no copy).

Launch configurations: inductor benchmarks a dynamic-shape kernel's candidate configs at its first
call and keeps the winner for every later token count. The engine's startup capture runs the
smallest batch bucket first, so the regions are tuned for the latency-bound shapes. Inductor's
on-disk autotune cache is off for the regions: it would hand a process the winner of whichever
process first ran the same kernel source (a test's shapes, another engine's larger batch). On the
H200 the drafter's per-head q / k RMSNorm kernels took 3.3 and 1.4 us per call at batch 1 in one
lease and 11 us each in another whose GPU tests had run first.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import Arg, CallFunction, KeywordArg, Match, PatternMatcherPass, \
    register_graph_pattern
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten


def _fusable_residual(match: Match) -> bool:
    """The addmm's added input has the output's shape (a residual, not a broadcast bias), and its sum
    feeds more of the graph than its output."""
    inp, node = match.kwargs["inp"], match.output_node()
    if all(user.op == "output" for user in node.users):
        return False
    val = inp.meta.get("val") if isinstance(inp, torch.fx.Node) else None
    out = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(out, torch.Tensor) or val.dim() != out.dim():
        return False
    return all(statically_known_true(a == b) for a, b in zip(val.shape, out.shape))


class ResidualMatmulPass(CustomGraphPass):
    """Post-grad pass: addmm(h, x, w) with a full residual h whose sum feeds more work -> h + mm(x, w)
    (module doc)."""

    def __init__(self) -> None:
        self._patterns = PatternMatcherPass()

        def unfuse(match: Match, mat1: torch.fx.Node, mat2: torch.fx.Node, *, inp: torch.fx.Node) -> None:
            match.replace_by_example(lambda h, x, w: h + x @ w, [inp, mat1, mat2])
        register_graph_pattern(CallFunction(aten.addmm, KeywordArg("inp"), Arg(), Arg()),
                               pass_dict=self._patterns, extra_check=_fusable_residual)(unfuse)

    def __call__(self, graph: torch.fx.Graph) -> None:
        self._patterns.apply(graph)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))


def compile_region(fn: Callable) -> Callable:
    """`fn` compiled by inductor for any token count, with `ResidualMatmulPass`, its kernels tuned at
    their first call in this process (module doc)."""
    return torch.compile(fn, dynamic=True, options={"post_grad_custom_post_pass": ResidualMatmulPass(),
                                                     "autotune_local_cache": False})
