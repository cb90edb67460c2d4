"""Token ids that stay on the device until the host needs them.

Three producers leave rows of token ids on the device: the draft graph (drafts [B, K]), the
overlap scheduler (a step's chosen tokens [B, 1]) and a verify step (its output rows, read by the
host while the GPU drafts). `PendingTokens` starts the host copy at once (pinned memory, one
event) without waiting; the next step reads the ids on the device (the graph runners gather them
into their input buffers on the same stream), and the host reads them when it needs the values,
waiting for that copy only.

`TokenRow` is one request's row: a `Sequence[int]` whose length is known without a sync, so
scheduling and segment building do not wait; reading a value waits for the copy.
`VerifyTokens` is a verify segment's tokens, [anchor, d1..dK], with device-resident drafts.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Iterator, Optional, Union

import torch

from ..attention_backend.interface import host_ints


class PendingTokens:
    """Token ids [B, K] on the device (a private copy: a graph's output buffer is rewritten by its
    next replay); `rows()` the host values (waits for the copy once)."""

    def __init__(self, device_ids: torch.Tensor):
        if device_ids.dim() != 2:
            raise ValueError(f"token ids must be [B, K], got shape {tuple(device_ids.shape)}")
        self.device = device_ids
        self.num_rows, self.width = device_ids.shape     # host ints: rows are cut many times per step
        self._event: Optional[torch.cuda.Event] = None
        if device_ids.is_cuda:
            self._host = torch.empty(device_ids.shape, dtype=device_ids.dtype, pin_memory=True)
            self._host.copy_(device_ids, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = device_ids
        self._rows: Optional[list[list[int]]] = None
        self._parts: tuple[tuple[PendingTokens, int], ...] = ()

    @classmethod
    def stacked(cls, parts: Sequence[tuple["PendingTokens", int]]) -> "PendingTokens":
        """The rows of several (pending, first column) parts as one [sum B, K]: one device cat, and no
        host copy of its own: the host rows come from the parts' copies (reading waits for those)."""
        ids = torch.cat([p.device[:, first:] for p, first in parts])
        out = cls.__new__(cls)
        out.device, (out.num_rows, out.width) = ids, ids.shape
        out._event, out._host, out._rows, out._parts = None, None, None, tuple(parts)
        return out

    def __len__(self) -> int:
        return self.num_rows

    def rows(self) -> list[list[int]]:
        """[B][K] host ints (the first call waits until the copy has landed)."""
        if self._rows is None:
            if self._parts:
                self._rows = [row[first:] for p, first in self._parts for row in p.rows()]
                return self._rows
            if self._event is not None:
                self._event.synchronize()
            self._rows = self._host.tolist()
        return self._rows

    def row(self, i: int, k: Optional[int] = None, offset: int = 0) -> "TokenRow":
        """Row i's k ids from column `offset` (all the rest by default)."""
        return TokenRow(self, i, self.width - offset if k is None else k, offset)


class _HostInts(Sequence):
    """A Sequence[int] whose values come from `tolist()` (which may wait for a copy)."""

    __slots__ = ()

    def tolist(self) -> list[int]:
        raise NotImplementedError

    def __getitem__(self, i: Union[int, slice]):
        return self.tolist()[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())


class TokenRow(_HostInts):
    """k ids of row `index` of a `PendingTokens`, from column `offset`; reading values waits for the
    host copy. `columns` is their slice of the device row."""

    __slots__ = ("pending", "index", "k", "offset")

    def __init__(self, pending: PendingTokens, index: int, k: int, offset: int = 0):
        if not 0 <= index < pending.num_rows or offset < 0 or not 0 <= k <= pending.width - offset:
            raise ValueError(f"token row {index} of {pending.num_rows}, {k} ids from column {offset} of "
                             f"{pending.width}: out of range")
        self.pending, self.index, self.k, self.offset = pending, index, k, offset

    def __len__(self) -> int:
        return self.k

    @property
    def columns(self) -> slice:
        return slice(self.offset, self.offset + self.k)

    def tolist(self) -> list[int]:
        return self.pending.rows()[self.index][self.columns]

    def __repr__(self) -> str:
        return f"TokenRow(row {self.index}, {self.k} ids from column {self.offset})"


def group_by_pending(rows: Sequence["TokenRow"], where: Sequence[int]
                     ) -> list[tuple[PendingTokens, list[int], list["TokenRow"]]]:
    """Device rows and their destinations grouped by the `PendingTokens` they belong to and their
    first column (first-seen order): one gather per producing step when a consumer copies them
    into its inputs."""
    groups: dict[tuple[int, int], tuple[PendingTokens, list[int], list[TokenRow]]] = {}
    pend, offset, g = None, -1, None
    for w, r in zip(where, rows):
        if r.pending is not pend or r.offset != offset:    # rows of one producer mostly come together
            pend, offset = r.pending, r.offset
            g = groups.get((id(pend), offset))
            if g is None:
                g = groups[(id(pend), offset)] = (pend, [], [])
        g[1].append(w)
        g[2].append(r)
    return list(groups.values())


def gather_into(dst: torch.Tensor, rows: Sequence["TokenRow"], at: Sequence[int]) -> None:
    """dst [N, k] on the device (a view): row at[n] <- the k ids of rows[n] from their first column,
    gathered behind the steps that produced them; one copy per producing step when its rows are
    consecutive on both sides, else one gather. The one device-row gather (input ids, draft ids,
    a continued segment's start shift as a [N, 1] view)."""
    k = dst.shape[1]
    for pend, js, toks in group_by_pending(rows, at):
        n, src, cols = len(js), [t.index for t in toks], slice(toks[0].offset, toks[0].offset + k)
        if js == list(range(js[0], js[0] + n)) and src == list(range(src[0], src[0] + n)):
            dst[js[0]:js[0] + n].copy_(pend.device[src[0]:src[0] + n, cols])
        else:
            dev = dst.device
            dst.index_copy_(0, host_ints(js, dev), pend.device.index_select(0, host_ints(src, dev))[:, cols])


def gather_shifts(dst: torch.Tensor, shifts: Sequence[Optional["TokenRow"]]) -> None:
    """dst [N] int64 on the device <- the continued segments' start shifts (`ForwardSegment.start_shift`,
    one committed count each, still on the device) for rows 0..len(shifts)-1; 0 in every other row
    (a segment without one, padding rows); never waits."""
    at, rows = [], []
    for j, sh in enumerate(shifts):
        if sh is not None:
            at.append(j)
            rows.append(sh)
    if len(at) < dst.shape[0]:    # else every row is written below
        dst.zero_()
    if at:
        gather_into(dst[:, None], rows, at)


class VerifyTokens(_HostInts):
    """A verify segment's tokens [anchor, d1..dk] with device-resident drafts."""

    __slots__ = ("anchor", "drafts", "_n")

    def __init__(self, anchor: int, drafts: TokenRow):
        self.anchor, self.drafts, self._n = anchor, drafts, 1 + len(drafts)

    def __len__(self) -> int:             # asked many times per step (scheduling, graph planning)
        return self._n

    def tolist(self) -> list[int]:
        return [self.anchor] + self.drafts.tolist()

    def __repr__(self) -> str:
        return f"VerifyTokens(anchor {self.anchor}, {self.drafts!r})"


def segment_drafts(tokens: Sequence[int]) -> Sequence[int]:
    """The drafts d1..dK of a verify segment [anchor, d1..dK], kept where they are: a `VerifyTokens`'
    device row, the columns after the anchor of a continued segment's `TokenRow`, or a list's tail."""
    if isinstance(tokens, VerifyTokens):
        return tokens.drafts
    if isinstance(tokens, TokenRow):
        return TokenRow(tokens.pending, tokens.index, tokens.k - 1, tokens.offset + 1)
    return list(tokens)[1:]
