"""Split a mixed target step into a CUDA-graph group and an eager rest; stitch their outputs.

With continuous batching and speculative decoding most steps are mixed: a prompt chunk of a
newly arrived request, a generation request whose verify segment is shorter, next to many
verify segments of q = K+1 tokens. Instead of running the whole step eagerly, the segments
of one shape (len(token_ids) == num_logits == q) replay a graph and the rest run in one
packed eager forward. One `ForwardOutput` is stitched from both (E = eager segments in step
order, G = graph segments in step order)::

    logits:   [ eager logits (packed, E order) | graph logits (q rows per segment, G order) ]
    captured: [ eager tokens (packed, E order) | graph tokens (q rows per segment, G order) ]

so per-segment offsets are no longer monotonic in step order; every consumer indexes by
segment (`logits_offsets[i]`, `token_offsets[i]`).
"""
from __future__ import annotations

from collections import Counter
from typing import Collection, Optional, Sequence

import torch


def graph_candidates(shapes: Sequence[tuple[int, int]], token_counts: Collection[int]) -> tuple[int, list[int]]:
    """Segments that could replay one graph shape.

    shapes: [(len(token_ids), num_logits)] per segment. A segment fits q when
    len == num_logits == q and q is one of `token_counts`. The q with the most fitting
    segments wins (ties: the larger q, more tokens off the eager path).
    Returns (q, indices in step order); (0, []) when no segment fits.
    """
    fits = Counter(n for n, k in shapes if n == k and n in token_counts)
    if not fits:
        return 0, []
    q = max(fits, key=lambda x: (fits[x], x))
    return q, [i for i, (n, k) in enumerate(shapes) if n == k == q]


def stitched_offsets(shapes: Sequence[tuple[int, int]], graph: Sequence[int],
                     q: int) -> tuple[list[int], list[int]]:
    """(logits_offsets, token_offsets) of every segment in the stitched tensors (module doc).

    shapes: [(len(token_ids), num_logits)] per segment; graph: indices (step order) of the
    segments that replayed a graph, each q tokens with q logits.
    """
    in_graph = {i: j for j, i in enumerate(graph)}
    if len(in_graph) != len(graph) or any(not 0 <= i < len(shapes) for i in graph):
        raise ValueError(f"graph indices {list(graph)} are not distinct segments of {len(shapes)}")
    eager_logits = sum(k for i, (_, k) in enumerate(shapes) if i not in in_graph)
    eager_tokens = sum(n for i, (n, _) in enumerate(shapes) if i not in in_graph)
    logits_offsets, token_offsets = [], []
    lo = to = 0
    for i, (n, k) in enumerate(shapes):
        j = in_graph.get(i)
        if j is None:
            logits_offsets.append(lo)
            token_offsets.append(to)
            lo, to = lo + k, to + n
        else:
            if n != q or k != q:
                raise ValueError(f"segment {i}: {n} tokens / {k} logits in a graph of {q} tokens")
            logits_offsets.append(eager_logits + j * q)
            token_offsets.append(eager_tokens + j * q)
    return logits_offsets, token_offsets


def cat_rows(eager: Optional[torch.Tensor], graph: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """[eager rows | graph rows]; None when either side has none (no capture layers); an
    eager side without rows (its segments wanted no logits) contributes nothing."""
    if eager is None or graph is None:
        return None
    if eager.shape[0] == 0:
        return graph
    return torch.cat([eager, graph], dim=0)
