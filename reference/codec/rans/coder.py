"""Interleaved rANS, the entropy coder of the rANS mode (FORMAT.md section 9.3).

rANS keeps the whole message in one integer, the *state* x. Coding symbol s, whose frequency is
f[s] out of M = 2^p (cumulative frequency c[s]), multiplies the state by about M / f[s]: the state
grows by exactly the symbol's information, -log2(f[s] / M) bits, with no rounding to whole bits
(the loss of a Huffman code). To keep x in 32 bits, the coder moves 16-bit *words* between the state
and a stream. The constants are those of DietGPU and of Giesen's rans_word:

    state in [L, 2^32), L = 2^16; words of 16 bits; M = 2^p, p <= 15.

    decode: slot = x mod M;  s = the symbol with c[s] <= slot < c[s] + f[s];
            x = f[s] * (x >> p) + slot - c[s];  if x < L: x = (x << 16) | next word
    encode: if x >= f[s] << (32 - p): emit x mod 2^16, x >>= 16;  x = (x // f[s]) << p + x mod f[s]
    + c[s]

Encoding runs backwards (the last symbol first): rANS is a stack. One refill always suffices after a
decode (x >> p >= 1, so the new x >= 1 before the refill and >= 2^16 after).

**Lanes.** A block of weights is cut into ``lanes`` interleaved sequences: weight j of the block is
step ``j // lanes`` of lane ``j % lanes``. Each lane has its own state; all lanes of a block share
one word stream. At each step every lane decodes one symbol, then the lanes that need a word take
the next words of the stream *in lane order*. A GPU warp decodes one block, one lane per thread,
each refill's place found by a prefix sum over the warp (a ballot). The encoder emits exactly the
words the decoder will read and sorts them into the decoder's reading order.

Both directions here run all lanes of many blocks in lockstep, step by step, with NumPy.
"""

from __future__ import annotations

import heapq

import numpy as np

from reference.codec.errors import CodecError

STATE_BITS, WORD_BITS = 32, 16
# L: the state is in [L, 2^32) between steps; every lane starts (encoder) and ends (decoder) at L
STATE_LOW = 1 << 16
WORD_MASK = (1 << WORD_BITS) - 1
MAX_PROB_BITS = 15  # frequencies (at most M) are stored as uint16
# decoded steps kept in a small step-major buffer before moving them to the result
TRANSPOSE_BLOCK = 16


def quantize(counts: np.ndarray, prob_bits: int) -> np.ndarray:
    """Frequencies summing to M = 2^prob_bits, each >= 1 where the count is > 0, close to counts * M
    / total.

    Start from floor(count * M / total) (at least 1), then hand out or take back single units, each
    time where it changes the coded size sum(count * log2(M / f)) the least. Deterministic: ties
    go to the lower symbol index. All zero counts give all zero frequencies.
    """
    counts = np.asarray(counts, np.int64)
    total, m = int(counts.sum()), 1 << prob_bits
    if total == 0:
        return np.zeros(len(counts), np.int64)
    used = np.flatnonzero(counts)
    if len(used) > m:
        raise CodecError(f"{len(used)} symbols cannot share {m} frequency slots")
    freq = np.zeros(len(counts), np.int64)
    freq[used] = np.maximum(1, counts[used] * m // total)
    c = counts.astype(np.float64)
    missing = m - int(freq.sum())
    if missing > 0:  # give +1 to the symbols that gain the most bits from it
        heap = [(-c[i] * np.log2((freq[i] + 1) / freq[i]), int(i)) for i in used]
        heapq.heapify(heap)
        for _ in range(missing):
            _, i = heapq.heappop(heap)
            freq[i] += 1
            heapq.heappush(heap, (-c[i] * np.log2((freq[i] + 1) / freq[i]), i))
    elif missing < 0:  # take 1 from the symbols (with f > 1) that lose the fewest bits by it
        heap = [(c[i] * np.log2(freq[i] / (freq[i] - 1)), int(i)) for i in used if freq[i] > 1]
        heapq.heapify(heap)
        for _ in range(-missing):
            _, i = heapq.heappop(heap)
            freq[i] -= 1
            if freq[i] > 1:
                heapq.heappush(heap, (c[i] * np.log2(freq[i] / (freq[i] - 1)), i))
    return freq


def cumulative(freqs: np.ndarray) -> np.ndarray:
    """c[s] = f[0] + ... + f[s - 1], per table (row)."""
    return np.cumsum(freqs, axis=-1) - freqs


def slot_tables(freqs: np.ndarray, values: np.ndarray, prob_bits: int) -> np.ndarray:
    """The decoding table: M packed entries per table (row of ``freqs``), tables concatenated.

    Slot ``slot`` of table k belongs to the symbol s with c[s] <= slot < c[s] + f[s]. Entry
    ``k * M + slot`` packs what decoding that slot needs into one int64, so that a decode step is
    one lookup: ``f[s] << 32 | values[k, s] << 16 | (slot - c[s])``; the step is then
    x = f * (x >> p) + (slot - c[s]). Every row of ``freqs`` must sum to M; values are < 2^16.
    """
    freqs = np.asarray(freqs, np.int64)
    m = 1 << prob_bits
    flat_freq = freqs.reshape(-1)
    # one entry per slot, table after table
    symbol = np.repeat(np.arange(flat_freq.size), flat_freq)
    bias = np.tile(np.arange(m), len(freqs)) - cumulative(freqs).reshape(-1)[symbol]
    value = np.asarray(values, np.int64).reshape(-1)[symbol]
    return (flat_freq[symbol] << 32) | (value << 16) | bias


def encode_lanes(
    symbols: np.ndarray, lengths: np.ndarray, freqs: np.ndarray, prob_bits: int,
    lows: np.ndarray | None = None, low_rows: np.ndarray | None = None,
    low_freqs: np.ndarray | None = None, rows: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Encode blocks of interleaved lanes; return (words uint16, words per block int64, states
    uint32 [B, lanes]).

    ``symbols`` [B, T, lanes]: the symbol (a column of ``freqs``) of the weight at step t of each
    lane; entries past the block's ``lengths[b]`` weights are ignored. ``freqs`` [B, S]: the
    frequency table of each block (rows may repeat). The words come out in the decoder's reading
    order, block after block; the states are the decoder's starting states.

    Two stages (FORMAT.md 9.4): with ``lows`` [B, T, lanes] every weight also has a second symbol,
    coded right after its first with the table ``low_freqs[low_rows[b, s]]`` chosen by the first
    symbol s (a step is: every lane's first symbol, then every lane's second symbol).

    Tables by context (FORMAT.md 9.2): with ``rows`` [B, T, lanes] each weight's first symbol is
    coded with ``freqs[rows[b, t, lane]]`` (then ``freqs`` is any number of tables) instead of
    ``freqs[b]``.
    """
    n_blocks, steps, lanes = symbols.shape
    freqs = np.asarray(freqs, np.int64)
    packed = (freqs << 32 | cumulative(freqs)).reshape(-1)  # f << 32 | c: one lookup per weight
    width = freqs.shape[1]
    row_base = np.repeat(np.arange(n_blocks, dtype=np.int64) * width, lanes)
    if lows is not None:
        low_freqs = np.asarray(low_freqs, np.int64)
        packed2 = (low_freqs << 32 | cumulative(low_freqs)).reshape(-1)
        rows2 = np.asarray(low_rows, np.int64).reshape(-1) * low_freqs.shape[1]
    x = np.full(n_blocks * lanes, STATE_LOW, np.int64)
    lane_pos = np.tile(np.arange(lanes), n_blocks)
    block_len = np.repeat(lengths, lanes)
    emitted: list[tuple[np.ndarray, np.ndarray]] = []  # (lane indices, words) emitted at each step

    def push(active: np.ndarray, fc: np.ndarray) -> None:  # code one symbol per active lane
        nonlocal x
        f, c = np.where(active, fc >> 32, 1), fc & 0xFFFFFFFF
        if np.any(f == 0):
            raise CodecError("a symbol with frequency 0 cannot be coded (the tables do not fit the "
                             "data)")
        emit = np.flatnonzero(active & (x >= f << (STATE_BITS - prob_bits)))
        emitted.append((emit, x[emit] & WORD_MASK))
        x[emit] >>= WORD_BITS
        q, r = np.divmod(x, f)
        x = np.where(active, (q << prob_bits) + r + c, x)

    for t in reversed(range(steps)):  # last symbol first: the second stage before the first
        active = t * lanes + lane_pos < block_len
        symbol = np.where(active, symbols[:, t].reshape(-1), 0)
        first = row_base + symbol  # the block's symbol (names the second stage's table)
        if lows is not None:
            low = np.where(active, lows[:, t].reshape(-1), 0)
            push(active, np.take(packed2, np.take(rows2, first) + low))
        if rows is not None:
            first = np.where(active, rows[:, t].reshape(-1), 0).astype(np.int64) * width + symbol
        push(active, np.take(packed, first))
    # The emitted words, steps in increasing order, each step's in (block, lane) order; a stable
    # sort by
    # block then gives the decoder's reading order: block, step, lane.
    emitted.reverse()
    lane_index = np.concatenate([i for i, _ in emitted] or [np.zeros(0, np.int64)])
    block = lane_index // lanes
    # a radix sort
    order = np.argsort(block.astype(np.uint16) if n_blocks <= 1 << 16 else block, kind="stable")
    words = np.concatenate([w for _, w in emitted] or [np.zeros(0, np.int64)])[order].astype(
        np.uint16
    )
    return (
        words,
        np.bincount(block, minlength=n_blocks),
        x.reshape(n_blocks, lanes).astype(np.uint32),
    )


def decode_lanes(
    words: np.ndarray, block_start: np.ndarray, block_end: np.ndarray, states: np.ndarray,
    lengths: np.ndarray, table_base: np.ndarray, table: np.ndarray, prob_bits: int,
    table2: np.ndarray | None = None, next_base: np.ndarray | None = None,
    context: tuple[np.ndarray, ...] | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Decode blocks of interleaved lanes; return their values, block after block (uint16), and
    with two stages the second symbols' values too (else None).

    Block b's words are ``words[block_start[b] : block_end[b]]``, its lanes start in ``states[b]``
    and it holds ``lengths[b]`` weights. Its decoding table starts at entry ``table_base[b]`` of
    ``table`` (see ``slot_tables``). Two stages: ``table2`` holds the second-stage decoding tables,
    and ``next_base`` (as long as ``table``) says, for each slot of ``table``, where in ``table2``
    the table of the second symbol starts. Tables by context (FORMAT.md 9.2): ``context`` =
    (first, stride, period, offset, bases), the first four per block: weight j of block b (weight
    ``first[b] + j`` of its tensor) takes its table at entry ``bases[offset[b] + ((first[b] + j) //
    stride[b]) % period[b]]`` of ``table`` instead of ``table_base[b]`` (a table by block: period
    1). Raises CodecError unless every block reads exactly its own words and every lane ends in
    state L: a corrupt stream or state cannot pass unnoticed.

    The lanes of all blocks sit in one flat array, longest blocks first, so that the lanes still
    decoding at step t are a prefix of it; step t's values go to a small step-major buffer that is
    moved into the block-major result every TRANSPOSE_BLOCK steps.
    """
    n_blocks, lanes = states.shape
    if n_blocks == 0:
        return np.zeros(0, np.uint16), (None if table2 is None else np.zeros(0, np.uint16))
    steps = int(-(-lengths.max() // lanes))
    # longest first: the blocks still decoding are a prefix
    order = np.argsort(-lengths, kind="stable")
    x = states[order].reshape(-1).astype(np.int64)
    pos, length = block_start[order].astype(np.int64), lengths[order]
    base = np.repeat(table_base[order].astype(np.int64), lanes)
    if context is not None:  # each lane's weight index, divisor, period and first context entry
        first, stride, period, offset, bases = context
        lane_first = np.repeat(first[order].astype(np.int64), lanes) + np.tile(np.arange(lanes),
                                                                               n_blocks)
        lane_stride = np.repeat(stride[order].astype(np.int64), lanes)
        lane_period = np.repeat(period[order].astype(np.int64), lanes)
        lane_offset = np.repeat(offset[order].astype(np.int64), lanes)
    mask = (1 << prob_bits) - 1
    # (np.take cannot read from an empty array)
    words = words if len(words) else np.zeros(1, np.uint16)
    lane_pos = np.tile(np.arange(lanes), n_blocks)
    # blocks with length > t * lanes
    active_blocks = np.searchsorted(-length, -np.arange(steps) * lanes, side="left")
    stages = 1 if table2 is None else 2
    result = np.zeros((stages, n_blocks, steps * lanes), np.uint16)
    buffer = np.zeros((stages, TRANSPOSE_BLOCK, n_blocks * lanes), np.uint16)

    def decode(t: int, k: int, stage: int, tab: np.ndarray, where: np.ndarray) -> np.ndarray:
        """One symbol per lane of the first k blocks (stage 0 or 1, from table entries ``where`` +
        slot);
        returns the slot indices used."""
        n = k * lanes
        xs = x[:n]
        index = where + (xs & mask)
        entry = np.take(tab, index)  # np.take: faster than indexing
        new = (entry >> 32) * (xs >> prob_bits) + (entry & 0xFFFF)
        # some block's last, partial step: lanes past its end stand still
        if length[k - 1] < (t + 1) * lanes:
            active = t * lanes + lane_pos[:n] < np.repeat(length[:k], lanes)
            new, entry = np.where(active, new, xs), np.where(active, entry, 0)
        # these lanes take the next words of their block's stream, in lane order
        need = new < STATE_LOW
        # over all k blocks' lanes: a block's own count is the rise across its lanes
        taken = np.cumsum(need)
        before = np.concatenate([[0], taken[lanes - 1 :: lanes]])
        # a lane that reads nothing gets some word, unused; a read past the block's end is caught
        # below
        word = np.take(
            words,
            ((pos[:k] - before[:-1] - 1)[:, None] + taken.reshape(k, lanes)).reshape(-1),
            mode="clip",
        )
        pos[:k] += np.diff(before)
        x[:n] = np.where(need, (new << WORD_BITS) | word, new)
        buffer[stage, t % TRANSPOSE_BLOCK, :n] = entry >> 16  # the value (the cast drops f)
        return index

    for t in range(steps):
        k = active_blocks[t]
        if context is None:
            where = base[: k * lanes]
        else:
            n = k * lanes
            i = lane_first[:n] + t * lanes
            where = np.take(bases, lane_offset[:n] + (i // lane_stride[:n]) % lane_period[:n])
        index = decode(t, k, 0, table, where)
        if table2 is not None:
            decode(t, k, 1, table2, np.take(next_base, index))
        if t % TRANSPOSE_BLOCK == TRANSPOSE_BLOCK - 1 or t == steps - 1:
            t0 = t - t % TRANSPOSE_BLOCK
            moved = buffer[:, : t + 1 - t0].reshape(stages, t + 1 - t0, n_blocks, lanes)
            moved = moved.transpose(0, 2, 1, 3)
            result[:, :, t0 * lanes : (t + 1) * lanes] = moved.reshape(stages, n_blocks, -1)
    wrong = (pos != block_end[order]) | np.any(x.reshape(n_blocks, lanes) != STATE_LOW, axis=1)
    if wrong.any():
        raise CodecError(f"rANS stream is corrupt: block {int(order[np.flatnonzero(wrong)[0]])} "
                         "does not end where "
                         "it should (wrong number of words read, or a lane not back in its start "
                         "state)")
    keep = np.arange(steps * lanes) < lengths[:, None]
    back = np.argsort(order, kind="stable")
    return result[0][back][keep], (None if table2 is None else result[1][back][keep])
