"""A step's inputs in persistent buffers: built on the host with numpy, copied to the device once.

Per step the runner needs token ids, positions and KV slots per token, query offsets
(cu_seqlens_q), context lengths and block tables per request, and the rows that sample. Building
them as Python lists and `torch.tensor(..., device=cuda)` costs a host-device sync per tensor (a
pageable copy waits for the stream). Here they are written with numpy into one host staging
buffer (pinned on CUDA), whose used part travels in one non-blocking copy to a device twin of
the same layout. The device tensors are views that never move, so a CUDA graph captured over
them reads each step's values (cuda_graphs.py). On the CPU the staging buffer is the device
buffer: no copy at all.

Padding (`pad`) is what a graph of a larger size needs and changes no real row: pad tokens are
token 0 at position 0 with slot -1 (every `store_kv` skips it), pad requests have no query
tokens (cu_seqlens_q repeats the real token count) and context 0, pad sample rows read row 0.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

import numpy as np
import torch

from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.scheduler import SchedulerOutput
from orcaserve.scheduler.spec.rows import sample_rows

_ALIGN = 64  # bytes: every region starts aligned, as Triton specialises its pointer arguments
_computed = attrgetter("num_computed_tokens")
# Steps of up to this many decodes are written request by request (`_prepare_decodes`); larger
# ones by whole-array numpy, whose per-call cost the rows then amortise.
PER_REQUEST = 8


@dataclass(frozen=True)
class StepShape:
    """What `prepare` wrote, and the sizes a step runs at (`padded` by the graph runner)."""

    num_tokens: int  # T
    num_seqs: int  # B
    num_samples: int  # S
    width: int  # W, blocks in the longest block table of the step
    max_seqlen_q: int
    max_seqlen_k: int
    num_placeholders: int = 0  # P, tokens the previous step is still sampling (`patch`)

    @property
    def decode_only(self) -> bool:
        """Every request feeds one token (B == T): the step a decode graph serves."""
        return self.num_tokens == self.num_seqs


@dataclass(frozen=True)
class StepTensors:
    """Device views of one step's inputs, at its (padded) sizes."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, -1 = store nowhere
    sample_rows: torch.Tensor  # [S] int64
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, W] int32


class StepBuffers:
    """Host staging and device buffers for steps of up to `max_tokens` tokens and `max_seqs`
    requests of up to `max_blocks` KV blocks each."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, block_size: int, device: torch.device):
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.block_size = block_size
        self.device = device
        cuda = device.type == "cuda"
        # (name, dtype, count) in copy order: the block table last, since only its first B x W
        # entries are used, so one copy of a prefix carries everything.
        regions = [
            ("cu", torch.int32, max_seqs + 1),
            ("seq_lens", torch.int32, max_seqs),
            ("rows", torch.int64, max_seqs),
            ("tokens", torch.int64, max_tokens),
            ("positions", torch.int64, max_tokens),
            ("slots", torch.int64, max_tokens),
            ("ph_pos", torch.int64, max_seqs),  # placeholder tokens: where in `tokens`,
            ("ph_src", torch.int64, max_seqs),  # and which row of the previous step's ids
            ("table", torch.int32, max_seqs * max_blocks),
        ]
        self._offsets: dict[str, int] = {}
        size = 0
        for name, dtype, count in regions:
            self._offsets[name] = size
            size += -(-count * dtype.itemsize // _ALIGN) * _ALIGN
        self.host_bytes = torch.zeros(size, dtype=torch.uint8, pin_memory=cuda)
        self.dev_bytes = torch.zeros(size, dtype=torch.uint8, device=device) if cuda else self.host_bytes
        self.host = {n: self._view(self.host_bytes, n, dt, c) for n, dt, c in regions}
        self.dev = {n: self._view(self.dev_bytes, n, dt, c) for n, dt, c in regions}
        self.np = {n: t.numpy() for n, t in self.host.items()}
        # The table graphs read: full rows of max_blocks, so its stride never changes (the
        # compact [B, W] table of a step is scattered into it on the device).
        self.graph_table = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device)
        # Set when the last copy out of the staging buffer was queued: the next step's writes
        # wait for it (already done in practice: the step ends with the sampled ids' copy back).
        self._copied = torch.cuda.Event() if cuda else None
        # The previous step's sampled ids [S'] on the device, while this step's inputs hold
        # placeholders for them (asynchronous scheduling, docs/host-overlap.md "Placeholders").
        self.prev_tokens: torch.Tensor | None = None
        self._last: tuple[tuple[int, int, int, int | None], StepTensors] | None = None  # `tensors`' last

    def _view(self, buf: torch.Tensor, name: str, dtype: torch.dtype, count: int) -> torch.Tensor:
        start = self._offsets[name]
        return buf[start : start + count * dtype.itemsize].view(dtype)

    def prepare(self, sched: SchedulerOutput, kv: KVCacheManager) -> StepShape:
        """Write the step's inputs (unpadded) into the host staging buffer."""
        if self._copied is not None:
            self._copied.synchronize()
        nst = sched.num_scheduled_tokens
        reqs = list(sched.requests.values())  # in the batch's order, as `nst`
        counts = list(nst.values())
        starts = list(map(_computed, reqs))
        tables = kv.tables_of(nst)
        b = len(counts)
        t = sum(counts)
        s = len(sched.sampling)
        if 0 < b <= PER_REQUEST and t == b == s and not sched.spec:
            return self._prepare_decodes(reqs, starts, tables)
        if t == b:  # decodes only: one token each
            tokens = [r.all_token_ids[start] for r, start in zip(reqs, starts)]
        else:
            tokens = list(chain.from_iterable(r.all_token_ids[st : st + n] for r, st, n in zip(reqs, starts, counts)))
        nb = np.fromiter(map(len, tables), dtype=np.int64, count=b)
        width = int(nb.max())
        if width > self.max_blocks or t > self.max_tokens or b > self.max_seqs:
            raise ValueError(f"step of {t} tokens, {b} requests, {width} blocks exceeds the buffers' sizes")
        npb, bs = self.np, self.block_size
        q = np.array(counts, dtype=np.int64)
        start_np = np.array(starts, dtype=np.int64)
        cu = npb["cu"]
        cu[0] = 0
        np.cumsum(q, out=cu[1 : b + 1])
        npb["seq_lens"][:b] = start_np + q
        tok = npb["tokens"][:t]
        tok[:] = tokens
        last = cu[1 : b + 1] - 1  # [B] each request's last token
        if sched.spec:  # speculated rows sample at each checked position (spec/rows.py)
            npb["rows"][:s] = sample_rows(last, sched)
        elif s == b:
            npb["rows"][:s] = last
        else:  # the scheduler decides who samples; rows follow its order, the batch's
            sampling = {r.request_id for r in sched.sampling}
            npb["rows"][:s] = last[np.fromiter((rid in sampling for rid in nst), dtype=bool, count=b)]
        # Placeholders (the previous step's ids, still on the device): only ever a request's last token.
        ph_pos = np.flatnonzero(tok < 0)
        p = len(ph_pos)
        if p:
            owner = np.searchsorted(last, ph_pos)  # [P] the request of each
            npb["ph_pos"][:p] = ph_pos
            npb["ph_src"][:p] = [reqs[i].pending_row for i in owner.tolist()]
        # Token i of request r sits at position start_r + (i - cu_r).
        pos = npb["positions"][:t]
        pos[:] = np.arange(t)
        pos += np.repeat(start_np - cu[:b], q)
        flat = np.frombuffer(b"".join(tables), dtype=np.int64)  # [sum(nb)] the tables are int64 arrays
        first_block = np.cumsum(nb) - nb  # where each request's blocks start in `flat`
        npb["slots"][:t] = flat[np.repeat(first_block, q) + pos // bs] * bs + pos % bs
        table = npb["table"][: b * width].reshape(b, width)
        table[:] = 0
        table[np.arange(width)[None, :] < nb[:, None]] = flat  # row-major: each request's blocks in order
        return StepShape(t, b, s, width, int(q.max()), int(npb["seq_lens"][:b].max()), p)

    def _prepare_decodes(self, reqs: list[Request], starts: list[int], tables: list[array[int]]) -> StepShape:
        """`prepare` for a step of a few decodes that all sample, without speculation: the same
        entries, written request by request (at one stream `prepare`'s twenty numpy calls were most
        of its time: docs/one-stream.md, "At one row on the Zen 5: what the roof does not explain")."""
        b, npb, bs = len(reqs), self.np, self.block_size
        width = max(map(len, tables))
        if width > self.max_blocks or b > self.max_tokens or b > self.max_seqs:
            raise ValueError(f"step of {b} tokens, {b} requests, {width} blocks exceeds the buffers' sizes")
        npb["cu"][: b + 1] = range(b + 1)
        npb["rows"][:b] = range(b)
        tok, pos, lens, slots = npb["tokens"], npb["positions"], npb["seq_lens"], npb["slots"]
        table = npb["table"][: b * width].reshape(b, width)
        table.fill(0)
        p = 0
        for i, (r, start, blocks) in enumerate(zip(reqs, starts, tables)):
            token = tok[i] = r.all_token_ids[start]
            pos[i], lens[i] = start, start + 1
            slots[i] = blocks[start // bs] * bs + start % bs
            table[i, : len(blocks)] = np.frombuffer(blocks, dtype=np.int64)
            if token < 0:  # a placeholder for the previous step's id (`patch`)
                npb["ph_pos"][p], npb["ph_src"][p] = i, r.pending_row
                p += 1
        return StepShape(b, b, b, width, 1, max(starts) + 1, p)

    def pad(self, shape: StepShape, num_tokens: int, num_seqs: int, num_samples: int) -> None:
        """Fill the staging buffer's entries from the real counts up to the padded ones."""
        t, b, npb = shape.num_tokens, shape.num_seqs, self.np
        npb["tokens"][t:num_tokens] = 0
        npb["positions"][t:num_tokens] = 0
        npb["slots"][t:num_tokens] = -1
        npb["cu"][b + 1 : num_seqs + 1] = t
        npb["seq_lens"][b:num_seqs] = 0
        npb["rows"][shape.num_samples : num_samples] = 0

    def upload(self, shape: StepShape, graph_table: bool = False) -> None:
        """Queue the copy of the staging buffer's used part to the device (non-blocking); with
        `graph_table`, also scatter the step's [B, W] table into `graph_table`'s first rows."""
        end = self._offsets["table"] + shape.num_seqs * shape.width * 4
        if self._copied is not None:
            self.dev_bytes[:end].copy_(self.host_bytes[:end], non_blocking=True)
            self._copied.record()
        if graph_table:
            b, w = shape.num_seqs, shape.width
            self.graph_table[:b, :w].copy_(self.dev["table"][: b * w].view(b, w))
        if shape.num_placeholders:
            self.patch(shape.num_placeholders)

    def patch(self, num: int) -> None:
        """Fill the step's `num` placeholder tokens from the previous step's ids, on the device
        (queued behind that step's sampling: the host never waits for them)."""
        if self.prev_tokens is None:
            raise RuntimeError("a step with placeholder tokens but no previous step's ids")
        dev = self.dev
        src = self.prev_tokens.index_select(0, dev["ph_src"][:num])  # [P]
        dev["tokens"].index_copy_(0, dev["ph_pos"][:num], src)

    def tensors(self, num_tokens: int, num_seqs: int, num_samples: int, width: int | None) -> StepTensors:
        """Device views at the given sizes; the block table is the step's compact [B, width] one,
        or with `width` None the graph table (full rows). The last sizes' views are kept: they never
        move, and consecutive steps of one stream ask the same sizes (seven slices saved a step)."""
        key = (num_tokens, num_seqs, num_samples, width)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        dev = self.dev
        if width is None:
            table = self.graph_table[:num_seqs]
        else:
            table = dev["table"][: num_seqs * width].view(num_seqs, width)
        t = StepTensors(
            input_ids=dev["tokens"][:num_tokens],
            positions=dev["positions"][:num_tokens],
            slot_mapping=dev["slots"][:num_tokens],
            sample_rows=dev["rows"][:num_samples],
            cu_seqlens_q=dev["cu"][: num_seqs + 1],
            seq_lens=dev["seq_lens"][:num_seqs],
            block_tables=table,
        )
        self._last = (key, t)
        return t

    def reset_device(self, num_tokens: int, num_seqs: int) -> None:
        """Device inputs of a step with nothing to do (no query token, slot -1 everywhere): what
        a graph's warm-up and capture run over, so they neither read nor write real K/V."""
        dev = self.dev
        for name in ("tokens", "positions", "rows"):
            dev[name].zero_()
        dev["slots"][:num_tokens].fill_(-1)
        dev["cu"].zero_()
        dev["seq_lens"].zero_()
        self.graph_table[:num_seqs].zero_()
