"""A computed merge: one index map. Token t of the input goes to row `rows[b, t]` of the merged sequence;
merging is a mean over each row's tokens along that map (the backend's segment_mean, or a product with the map's
0/1 matrix where the backend prices that cheaper: merge_matrix), unmerging is one gather.
Where the inverse counts are known (proportional attention, restored tokens, downsampling asked for them) or the
backend prefers it (torch under a graph compiler), every merging site's mean is a sum times those kept counts:
three kernels on CUDA where torch's own mean runs seven.
matching.py computes it; the runtime applies it to every sub-layer's tokens, rotary rows and outputs.
Past 300 lines as one class: the map's every use (whole, head- or tail-joined sequences, per-token tables such as
rotary rows, per-sample or shared) reads the same rows, and the hot ones run inline with no helper frame.
"""
from __future__ import annotations

import math
from typing import Any, Sequence, Tuple

from .backend import Backend

# ToMe for SD's merge passes `mode` to scatter_reduce; every reduction it accepts is served here.
MERGE_MODES = ("mean", "sum", "amax", "amin", "prod")


class TokenMerge:
    """A computed merge: `merge` maps [B, N, C] to [B, N - r, C], `unmerge` maps back.

    Holds only tensors and ints, so it lives as long as the call (or the recompute) using it.
    """

    def __init__(self, xp: Backend, flat_rows: Any, inv_counts: Any, batch: int, n: int, m: int,
                 rows: Any = None, representatives: Any = None, memo: Any = None):
        self._xp = xp
        # The matcher's dict of index constants by shape (Matching's memo), where the merge came from a matching:
        # a sequence with text in front then merges and unmerges over one map of its whole length (_whole_rows)
        self._memo = memo
        self._whole: dict = {}  # text length -> that map [B * (T + N)], built once per merge
        self._whole_inv: dict = {}  # text length -> that map's inverse counts [B * (T + M), 1] (float32)
        # [B * M, 1] float32 inverse counts for segment_mean (a half-precision mean is scaled in float32 and rounded
        # once, as a division would be: 1/3 in bfloat16 is 0.2% off)
        self._inv_flat: Any = None
        self._flat_rows = flat_rows  # [B*N] row of the flattened merged tensor for each token
        # [B, M, 1] float32, 1 / tokens in each merged row; None: counted from the rows when first asked for (a mean
        # merge needs no counts: proportional attention and token restoring ask)
        self._inv_counts = inv_counts
        self._kept_counts = inv_counts is not None or xp.prefers_kept_counts()  # every mean a sum times them
        # The map's 0/1 matrix where the backend takes a mean merge as a product with it (merge_matrix): None until
        # the first merge asks, False where the backend scatters; per text length for merge_tail's whole map
        self._matrix: Any = None
        self._whole_matrix: dict = {}
        self.batch, self.num_tokens, self.num_merged = batch, n, m
        self._rows = rows  # [N] merged row of each token, when one map serves the whole batch
        # For each merged row, the token that stands for it (see compute_coordinate_merges): [M] when one map
        # serves the batch, [B, M] when each sample has its own.
        self.representatives = representatives
        self._row_index: dict = {}  # per-sample row indices of per-token tables, by (head, after): _sample_rows
        self._rep_rank = None  # representatives' rank (1: one map for the batch; 2: per sample), once read

    def _wrong(self, x: Any, expected: int, what: str) -> ValueError:
        return ValueError(f"{what} expects [{self.batch}, {expected}, C] tokens, got {list(self._xp.shape(x))}")

    def merge(self, x: Any, mode: str = "mean") -> Any:
        """Each merged row reduces its tokens (a dst and the src merged into it) with `mode`."""
        if mode not in MERGE_MODES:
            raise ValueError(f"merge mode must be one of {MERGE_MODES}, got {mode!r}")
        b, n, c = self._xp.shape(x)
        if b != self.batch or n != self.num_tokens:
            raise self._wrong(x, self.num_tokens, "merge")
        return self._merged(x, c, mode)

    def _merged(self, x: Any, c: int, mode: str = "mean") -> Any:
        """merge of `x` [B, N, C] (its shape checked by the caller)."""
        xp, b, m = self._xp, self.batch, self.num_merged
        flat = xp.reshape(x, [b * self.num_tokens, c])
        if mode == "mean":
            matrix = self._matrix
            if matrix is None:
                matrix = self._matrix = self._matrix_of(self._flat_rows, self.num_tokens, m, x)
            inv = self._inv_flat
            if inv is None and (matrix is not False or self._kept_counts or self._inv_counts is not None):
                inv = self._inv_flat = xp.reshape(self.inv_counts, [b * m, 1])
            if matrix is not False:
                return xp.reshape(xp.matrix_mean(matrix, flat, inv), [b, m, c])
            return xp.reshape(xp.segment_mean(flat, self._flat_rows, b * m, inv), [b, m, c])
        target = xp.zeros([b * m, c], x)
        if mode == "sum":
            return xp.reshape(xp.scatter_add(target, self._flat_rows, flat), [b, m, c])
        return xp.reshape(xp.scatter_reduce(target, self._flat_rows, flat, mode), [b, m, c])

    def _matrix_of(self, rows: Any, n: int, m: int, like: Any) -> Any:
        """The backend's matrix of a map of `rows` (n tokens into m rows a sample), or False where it scatters."""
        matrix = self._xp.merge_matrix(rows, self.batch, n, m, like)
        return False if matrix is None else matrix

    def unmerge(self, x: Any) -> Any:
        xp = self._xp
        b, m, c = xp.shape(x)
        if b != self.batch or m != self.num_merged:
            raise self._wrong(x, self.num_merged, "unmerge")
        return xp.reshape(xp.take(xp.reshape(x, [b * m, c]), self._flat_rows, 0), [b, self.num_tokens, c])  # _unmerged

    def _unmerged(self, x: Any, c: int) -> Any:
        xp, b = self._xp, self.batch
        return xp.reshape(xp.take(xp.reshape(x, [b * self.num_merged, c]), self._flat_rows, 0), [b, self.num_tokens, c])

    # A sequence [B, S, C] whose last N tokens are the image (text in front, as in Flux's single blocks):
    # the image segment merges and unmerges, the tokens in front pass as they are.
    def merge_tail(self, x: Any) -> Any:
        xp = self._xp
        b, s, c = xp.shape(x)
        if s == self.num_tokens and b == self.batch:  # _merged's mean inline: every merging site of every block
            m = self.num_merged
            matrix = self._matrix
            if matrix is None:
                matrix = self._matrix = self._matrix_of(self._flat_rows, s, m, x)
            inv = self._inv_flat
            if inv is None and (matrix is not False or self._kept_counts or self._inv_counts is not None):
                inv = self._inv_flat = xp.reshape(self.inv_counts, [b * m, 1])
            if matrix is not False:
                return xp.reshape(xp.matrix_mean(matrix, xp.reshape(x, [b * s, c]), inv), [b, m, c])
            return xp.reshape(xp.segment_mean(xp.reshape(x, [b * s, c]), self._flat_rows, b * m, inv), [b, m, c])
        if b != self.batch or s < self.num_tokens:
            raise self._wrong(x, self.num_tokens, "merge")
        if self._memo is not None:  # text rows each their own row of one map: no copy of the image part, no concat
            t, m = s - self.num_tokens, self.num_merged
            rows = self._whole.get(t)
            rows = self._whole_rows(t) if rows is None else rows
            matrix = self._whole_matrix.get(t)
            if matrix is None:
                matrix = self._whole_matrix[t] = self._matrix_of(rows, s, t + m, x)
            inv = self._whole_inv.get(t)
            if inv is None and (matrix is not False or self._kept_counts or self._inv_counts is not None):
                inv = self._whole_inv_of(t)
            if matrix is not False:
                return xp.reshape(xp.matrix_mean(matrix, xp.reshape(x, [b * s, c]), inv), [b, t + m, c])
            return xp.reshape(xp.segment_mean(xp.reshape(x, [b * s, c]), rows, b * (t + m), inv), [b, t + m, c])
        return self._xp.concat([x[:, : s - self.num_tokens], self._merged(x[:, s - self.num_tokens:], c)], 1)

    def unmerge_tail(self, x: Any) -> Any:
        xp = self._xp
        b, s, c = xp.shape(x)
        if s == self.num_merged and b == self.batch:  # _unmerged inline: every merging site of every block
            return xp.reshape(xp.take(xp.reshape(x, [b * s, c]), self._flat_rows, 0), [b, self.num_tokens, c])
        if b != self.batch or s < self.num_merged:
            raise self._wrong(x, self.num_merged, "unmerge")
        if self._memo is not None:  # merge_tail's map of the whole sequence: one gather gives text and image back
            t = s - self.num_merged
            rows = self._whole.get(t)
            rows = self._whole_rows(t) if rows is None else rows
            return xp.reshape(xp.take(xp.reshape(x, [b * s, c]), rows, 0), [b, t + self.num_tokens, c])
        return self._xp.concat([x[:, : s - self.num_merged], self._unmerged(x[:, s - self.num_merged:], c)], 1)

    def _whole_rows(self, text: int) -> Any:
        """[B * (T + N)]: the row of each token of [text, image] sequences in their merged [text, merged image]
        form (T + M rows a sample): text token i of sample k keeps row k(T + M) + i, an image token goes to its
        merged row moved past its sample's text and the text before it. The constants come from the memo, so a
        merge builds it with an add and a concat, once for its merge and its unmerge."""
        xp, b, n, m = self._xp, self.batch, self.num_tokens, self.num_merged
        like = self._flat_rows
        key = f"whole {xp.name} {getattr(like, 'device', None) or getattr(like, 'place', None)} {b} {m} {text}"
        fixed = self._memo.get(key)
        if fixed is None:
            starts = xp.reshape(xp.arange(b * (text + m), like, step=text + m), [b, 1])
            fixed = (starts + xp.reshape(xp.arange(text, like), [1, text]),  # the text's rows
                     xp.reshape(xp.arange(b * text, like, step=text), [b, 1]) + text)  # each sample's shift
            self._memo[key] = fixed
        rows = xp.reshape(xp.concat([fixed[0], xp.reshape(self._flat_rows, [b, n]) + fixed[1]], 1), [b * (text + n)])
        self._whole[text] = rows
        return rows

    def _whole_inv_of(self, text: int) -> Any:
        """[B * (T + M), 1]: _whole_rows' float32 inverse counts (1 for each text row, alone in its row), kept."""
        xp, b, m = self._xp, self.batch, self.num_merged
        image = xp.reshape(self.inv_counts, [b, m])
        inv = xp.reshape(xp.concat([xp.zeros([b, text], image) + 1.0, image], 1), [b * (text + m), 1])
        self._whole_inv[text] = inv
        return inv

    # A sequence [B, S, C] whose first N tokens are the image (text after it, as in HunyuanVideo's single blocks):
    # the image segment merges and unmerges, the tokens after it pass as they are.
    def merge_head(self, x: Any) -> Any:
        b, s, c = self._xp.shape(x)
        if s == self.num_tokens and b == self.batch:
            return self._merged(x, c)
        if b != self.batch or s < self.num_tokens:
            raise self._wrong(x, self.num_tokens, "merge")
        return self._xp.concat([self._merged(x[:, : self.num_tokens], c), x[:, self.num_tokens:]], 1)

    def unmerge_head(self, x: Any) -> Any:
        b, s, c = self._xp.shape(x)
        if s == self.num_merged and b == self.batch:
            return self._unmerged(x, c)
        if b != self.batch or s < self.num_merged:
            raise self._wrong(x, self.num_merged, "unmerge")
        return self._xp.concat([self._unmerged(x[:, : self.num_merged], c), x[:, self.num_merged:]], 1)

    def spread(self, x: Any, tail: bool = False, head: bool = False) -> Any:
        """Each token's difference to its merged row's mean: x - unmerge(merge(x)) (zero for tokens alone in their
        row). With `tail`, over the last N tokens of a longer sequence (tokens in front get zero); with `head`, over
        its first N (tokens after them get zero)."""
        if head:
            return x - self.unmerge_head(self.merge_head(x))
        if tail:
            return x - self.unmerge_tail(self.merge_tail(x))
        return x - self.unmerge(self.merge(x))

    def gather_rows(self, table: Any, axis: int = 0, image_first: bool = False) -> Any:
        """Rows of a per-token table (rotary positions) along `axis`, whose last N rows are the image's and
        any rows before them the text's (Flux: [text + image, D]; Wan: [1, image, 1, D] with axis=1; ComfyUI's
        Flux: [B, 1, text + image, ...] with axis=2): text rows stay, the image rows become one row per merged
        token, its representative's. One index, one gather.

        With a representative per sample ([B, M]) the rows differ by sample: a table with axes before `axis`
        (its first of size 1 or B, any others of any size: LTX-2's split rows [B, heads, S, D]) gives
        [B, ..., S', ...]; a table whose rows come first ([S, D]) gains a batch axis in front, [B, S', D]. A negative
        `axis` counts from the table's last axis. With `image_first`, the image's rows are the first N and the text's
        follow them (HiDream's rows over [image, text])."""
        xp = self._xp
        shape = xp.shape(table)
        axis = axis % len(shape)  # a negative axis from the end (LTX-2's rows: -2, with or without heads)
        s = shape[axis]
        if s < self.num_tokens:
            raise ValueError(f"a table with rows along axis {axis} must hold the image's {self.num_tokens} rows "
                             f"(after any text rows), got {s}")
        text = s - self.num_tokens
        head = 0 if image_first else text
        if self._rep_rank is None:
            self._rep_rank = len(xp.shape(self.representatives))
        if self._rep_rank == 1:
            if text == 0:
                return xp.take(table, self.representatives, axis)
            rest = xp.arange(text, self.representatives) + (self.num_tokens if image_first else 0)
            parts = [self.representatives, rest] if image_first else [rest, self.representatives + head]
            return xp.take(table, xp.concat(parts, 0), axis)
        if axis == 0:  # rows first ([S, D], Flux's), at every block
            return self._gather_rows_first(table, shape, text, image_first)
        return self._gather_sample_rows(table, axis, head, text - head, shape)

    def _gather_rows_first(self, table: Any, shape: Sequence[int], text: int, image_first: bool) -> Any:
        """gather_rows' per-sample case for a table [S, D] (rows first): [B, S', D]. The image's rows are taken by
        representative from the image's part of the table (a view), and the text's rows, the same for every
        sample, are joined to them as a broadcast: two kernels, where an index over the whole table would be built
        from the representatives by three more at every block."""
        xp, b, m, n = self._xp, self.batch, self.num_merged, self.num_tokens
        rest = list(shape[1:])
        image = (table[:n] if image_first else table[text:]) if text else table
        rows = xp.reshape(xp.take(image, xp.reshape(self.representatives, [b * m]), 0), [b, m] + rest)
        if not text:
            return rows
        fixed = xp.broadcast_to(xp.reshape(table[n:] if image_first else table[:text], [1, text] + rest),
                                [b, text] + rest)
        return xp.concat([rows, fixed] if image_first else [fixed, rows], 1)

    def gather_tables(self, tables: Sequence[Any], axis: int = 0, image_first: bool = False) -> Tuple[Any, ...]:
        """gather_rows of each of `tables` (a rotary embedding's (cos, sin)), as a tuple."""
        xp = self._xp
        if self._rep_rank is None:
            self._rep_rank = len(xp.shape(self.representatives))
        gathered = []
        for table in tables:
            shape = xp.shape(table)
            text = shape[0] - self.num_tokens
            if axis != 0 or self._rep_rank != 2 or text < 0:  # gather_rows' other cases (and its refusal)
                gathered.append(self.gather_rows(table, axis, image_first))
            else:  # gather_rows' per-sample case for rows first ([S, D], Flux's), with no frame between
                gathered.append(self._gather_rows_first(table, shape, text, image_first))
        return tuple(gathered)

    def _sample_rows(self, head: int, after: int) -> Any:
        """[B, head + M + after]: each sample's rows of a per-token table, `head` text rows before the image's and
        `after` after them; built once per merge (a block's sites and its (cos, sin) share it)."""
        key = (head, after)
        rows = self._row_index.get(key)
        if rows is None:
            xp, b = self._xp, self.batch
            rows = self.representatives + head if head else self.representatives  # [B, M]
            if head:
                text = xp.broadcast_to(xp.reshape(xp.arange(head, rows), [1, head]), [b, head])
                rows = xp.concat([text, rows], 1)
            if after:  # text rows after the image's
                text = xp.broadcast_to(xp.reshape(xp.arange(after, rows) + self.num_tokens, [1, after]), [b, after])
                rows = xp.concat([rows, text], 1)
            self._row_index[key] = rows
        return rows

    def _gather_sample_rows(self, table: Any, axis: int, head: int, after: int = 0, shape: Any = None) -> Any:
        xp, b = self._xp, self.batch
        shape = list(xp.shape(table) if shape is None else shape)
        s, rest = shape[axis], shape[axis + 1:]
        rows = self._sample_rows(head, after)
        kept = head + self.num_merged + after
        if axis == 0:
            return xp.reshape(xp.take(table, xp.reshape(rows, [b * kept]), 0), [b, kept] + rest)
        lead = shape[:axis]
        if lead[0] not in (1, b):
            raise ValueError(f"per-sample rows need a table [B or 1, ..., S, ...] with rows along axis {axis}, got "
                             f"{shape} for a batch of {b}")
        inner = math.prod(lead[1:])
        if lead[0] == 1 and inner == 1:  # one table for every sample (Wan's [1, S, 1, D]): one gather of its rows
            return xp.reshape(xp.take(xp.reshape(table, [s] + rest), xp.reshape(rows, [b * kept]), 0),
                              [b] + lead[1:] + [kept] + rest)
        # Axes between the batch and the rows (LTX-2's heads, or 1s) take their sample's rows each: one index over
        # the table flattened to [B * inner * S, ...], block (k, j) starting at (k * inner + j) * s.
        flat = xp.reshape(xp.broadcast_to(table, [b] + lead[1:] + shape[axis:]), [b * inner * s] + rest)
        starts = xp.reshape(xp.arange(b * inner * s, rows, step=s), [b, inner, 1])
        index = xp.reshape(rows, [b, 1, kept]) + starts  # [B, inner, kept]
        return xp.reshape(xp.take(flat, xp.reshape(index, [b * inner * kept]), 0), [b] + lead[1:] + [kept] + rest)

    @property
    def inv_counts(self) -> Any:
        """[B, M, 1]: 1 / the tokens in each merged row."""
        if self._inv_counts is None:
            xp, b, m = self._xp, self.batch, self.num_merged
            self._inv_counts = xp.reshape(1.0 / xp.counts(self._flat_rows, b * m), [b, m, 1])
        return self._inv_counts

    @property
    def shared(self) -> bool:
        """Whether one map serves every sample of the batch."""
        return self._rows is not None

    def sample_rows(self) -> Any:
        """[B, N]: the merged row of each token within its own sample's M rows."""
        xp, b, m = self._xp, self.batch, self.num_merged
        return xp.reshape(self._flat_rows, [b, self.num_tokens]) - xp.reshape(xp.arange(b * m, self._flat_rows, step=m), [b, 1])

    def with_passing_tail(self, tail: int) -> "TokenMerge":
        """This merge over N tokens followed by `tail` tokens that pass whole, each its own merged row after
        the M rows: a reference image's tokens joined after the target's (Flux Kontext) never merge with them.
        The same index map, extended: merge, unmerge and rotary rows need nothing else."""
        if tail <= 0:
            return self
        xp, b, n, m = self._xp, self.batch, self.num_tokens, self.num_merged
        n2, m2 = n + tail, m + tail
        own = xp.arange(tail, self._flat_rows) + m  # the tail's rows within a sample
        rows = xp.concat([self.sample_rows(), xp.broadcast_to(xp.reshape(own, [1, tail]), [b, tail])], 1)
        flat_rows = xp.reshape(rows + xp.reshape(xp.arange(b * m2, rows, step=m2), [b, 1]), [b * n2])
        shared = None if self._rows is None else xp.concat([self._rows, own], 0)
        reps, tail_reps = self.representatives, xp.arange(tail, self._flat_rows) + n
        if reps is not None and len(xp.shape(reps)) == 2:
            reps = xp.concat([reps, xp.broadcast_to(xp.reshape(tail_reps, [1, tail]), [b, tail])], 1)
        elif reps is not None:
            reps = xp.concat([reps, tail_reps], 0)
        return TokenMerge(xp, flat_rows, None, b, n2, m2, shared, reps)

    def with_passing_head(self, head: int) -> "TokenMerge":
        """This merge over N tokens preceded by `head` tokens that pass whole, each its own merged row before the M
        rows: condition tokens joined before the target's (Framepack's history latents) never merge with them."""
        if head <= 0:
            return self
        xp, b, n, m = self._xp, self.batch, self.num_tokens, self.num_merged
        n2, m2 = n + head, m + head
        own = xp.arange(head, self._flat_rows)  # the head's rows within a sample, first
        rows = xp.concat([xp.broadcast_to(xp.reshape(own, [1, head]), [b, head]), self.sample_rows() + head], 1)
        flat_rows = xp.reshape(rows + xp.reshape(xp.arange(b * m2, rows, step=m2), [b, 1]), [b * n2])
        shared = None if self._rows is None else xp.concat([own, self._rows + head], 0)
        reps = self.representatives
        if reps is not None and len(xp.shape(reps)) == 2:
            reps = xp.concat([xp.broadcast_to(xp.reshape(own, [1, head]), [b, head]), reps + head], 1)
        elif reps is not None:
            reps = xp.concat([own, reps + head], 0)
        return TokenMerge(xp, flat_rows, None, b, n2, m2, shared, reps)

    def placed(self, starts: Any, total: int) -> "TokenMerge":
        """This merge over N image tokens placed in a sequence of `total` tokens whose image starts at `starts`
        ([B] integer, on the device: a place per sample) and whose other tokens pass whole, each its own row, in
        place: sample b's merged sequence is its tokens before the image, the image's M rows, then its tokens
        after, `total - (N - M)` rows for every sample. Unified sequences (Z-Image's [image, text, padding],
        Lumina 2's [text_b, image, padding] with a text length per sample) merge so with no host read; rotary rows
        and a key-padding mask follow the representatives (gather_rows). Nothing is read on the host."""
        xp, b, n, m = self._xp, self.batch, self.num_tokens, self.num_merged
        r, kept = n - m, total - (n - m)
        starts = xp.reshape(starts, [b, 1])
        sample = xp.reshape(xp.arange(b, starts), [b, 1])

        def inside(length: int, size: int) -> Tuple[Any, Any, Any]:
            at = xp.reshape(xp.arange(length, starts), [1, length])
            rel = at - starts  # [B, length]: place relative to the image's first token
            within = (rel >= 0) & (rel < size)
            return at, rel, xp.where(within, rel, rel * 0) + sample * size  # flat index into a [B * size] table

        at, rel, flat = inside(total, n)
        image = xp.take(xp.reshape(self.sample_rows(), [b * n]), xp.reshape(flat, [b * total]), 0)
        image = xp.reshape(image, [b, total]) + starts
        rows = xp.where(rel < 0, at + rel * 0, xp.where(rel < n, image, at - r))
        flat_rows = xp.reshape(rows + sample * kept, [b * total])
        reps = None
        if self.representatives is not None:
            at, rel, flat = inside(kept, m)
            own = xp.reshape(xp.broadcast_to(self.representatives, [b, m]), [b * m])
            reps = xp.reshape(xp.take(own, xp.reshape(flat, [b * kept]), 0), [b, kept]) + starts
            reps = xp.where(rel < 0, at + rel * 0, xp.where(rel < m, reps, at + r))
        return TokenMerge(xp, flat_rows, None, b, total, kept, None, reps)

    def for_batch(self, batch: int) -> "TokenMerge":
        """This merge (computed for one map) applied to every sample of a batch of `batch`."""
        xp, n, m = self._xp, self.num_tokens, self.num_merged
        if self._rows is None:
            raise ValueError("only a merge computed for the whole batch (compute_shared_merge) can be broadcast")
        offsets = xp.reshape(xp.arange(batch * m, self._rows, step=m), [batch, 1])
        flat_rows = xp.reshape(xp.reshape(self._rows, [1, n]) + offsets, [batch * n])
        inv_counts = None if self._inv_counts is None else xp.broadcast_to(self._inv_counts, [batch, m, 1])
        return TokenMerge(xp, flat_rows, inv_counts, batch, n, m, self._rows, self.representatives)
