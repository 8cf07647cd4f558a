"""Runs the model over a batch of scheduled chunks, with KV living in the pool's storage.

The runner owns the KV tensor (``[layers, 2, kv_heads, num_blocks * block_size,
head_dim]``, allocated once) and turns a list of ``SeqChunk`` into one flattened forward
pass; logits are computed only at the positions that sample a token. Every read and write
of that tensor happens here: ``execute`` (scheduled steps), ``precompute`` (PML modules, no
logits), ``write_kv`` / ``read_kv`` (module KV from and to the schema store), ``copy_shifted``
(document KV copied to a request's blocks at its positions), ``forward_by_position`` (a
scratch pass for blend's deviation score, ``engine/blend_pass.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvreuse.engine import attention, llama_forward as llama
from kvreuse.engine.attention import DecodeBatch, ForwardContext, KeyTable, PrefillItem
from kvreuse.engine.key_frames import KeyFrames
from kvreuse.engine.kv_quant import KVFormat, KVStore
from kvreuse.engine.rope_shift import RopeShift
from kvreuse.engine.seq_chunk import KVLayout, SeqChunk  # re-exported: the runner's input types

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class ModelRunner:
    """Owns the model and the KV storage; not thread-safe (engine thread only)."""

    def __init__(
        self,
        model: PreTrainedModel,
        layout: KVLayout,
        num_blocks: int,
        block_size: int,
        deterministic: bool = False,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """``deterministic``: every token's logits independent of what shares its step (the
        batch-invariant forward and attention, ``--deterministic``); a plain Llama model only.
        ``kv_cache_dtype``: the pool's format (``engine/kv_quant.py``, ``--kv-cache-dtype``)."""
        self.model = model
        self.deterministic = deterministic
        self.layout = layout
        self.block_size = block_size
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        name = attention.register()
        model.set_attn_implementation(name)
        # Plain Llama checkpoints run our leaner forward (same weights, same results);
        # other families keep the transformers forward with our attention plugged in.
        self._llama = llama.LlamaForward(model, invariant=deterministic) if llama.supports(model) else None
        if deterministic and self._llama is None:
            raise ValueError(
                f"--deterministic needs a plain Llama model (kvreuse's own forward); "
                f"{getattr(model.config, 'model_type', type(model).__name__)} runs the transformers forward"
            )
        # A decode over a long context reads its keys in place (as a one-token prefill item)
        # instead of joining the padded batch, whose gather copies the whole context per step.
        # Deterministic: 0, so no decode joins a padded batch (each is its own item, as alone).
        self.decode_in_place_min = 0 if deterministic else DECODE_IN_PLACE_MIN
        self._rope_shift: RopeShift | None = None  # built on the first copy_shifted (documents)
        # Head-major so that gathering a sequence's slots gives [kv_heads, L, head_dim], the
        # layout attention's matmuls take, with one copy.
        self.kv_format = KVFormat.resolve(kv_cache_dtype, self.dtype)
        self.kv = KVStore.allocate(
            self.kv_format,
            layout.num_layers,
            layout.num_kv_heads,
            num_blocks * block_size,
            layout.head_dim,
            self.device,
        )
        self.kv_cache = self.kv.tensor  # [layers, 2, kv_heads, slots, row]: the pool's bytes (tiers move them)

    @property
    def forward_impl(self) -> str:
        """Which forward runs: ``"kvreuse-llama"`` (engine/llama_forward.py) or ``"transformers"``."""
        return "transformers" if self._llama is None else "kvreuse-llama"

    @torch.inference_mode()
    def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Compute every chunk; returns fp32 logits ``[num_rows, vocab]`` in chunk order
        (only chunks with ``sample=True`` get rows: ``num_logits`` each, in token order)."""
        dev = self.device
        token_ids: list[int] = []
        positions: list[int] = []
        new_slots: list[np.ndarray] = []
        sample_index: list[int] = []
        prefills: list[PrefillItem] = []
        decode_rows: list[tuple[int, SeqChunk]] = []
        for chunk in chunks:
            start = len(token_ids)
            token_ids += chunk.token_ids
            positions += chunk.positions
            new_slots.append(chunk.new_slots)
            if chunk.sample:
                sample_index.extend(range(len(token_ids) - chunk.num_logits, len(token_ids)))
            if chunk.by_position:
                prefills.append(self._positional_item(start, chunk))
            elif (
                len(chunk.token_ids) == 1
                and 0 < chunk.num_context < self.decode_in_place_min
                and chunk.keys.context_shifts is None
            ):  # moved keys are read in place, never padded
                decode_rows.append((start, chunk))
            else:
                prefills.append(self._prefill_item(start, chunk))
        if len(decode_rows) == 1:  # a lone decode reads in place: no padded batch to share a gather with
            prefills.append(self._prefill_item(*decode_rows.pop()))
        ctx = ForwardContext(
            kv_cache=self.kv,
            slot_mapping=torch.from_numpy(np.concatenate(new_slots)).to(dev),  # [T]
            prefills=prefills,
            decodes=self._decode_batch(decode_rows) if decode_rows else None,
            invariant=self.deterministic,
        )
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=dev)  # [1, T]
        position_ids = torch.tensor([positions], dtype=torch.long, device=dev)  # [1, T]
        logits_index = torch.tensor(sample_index, dtype=torch.long, device=dev)  # [num_sampled]
        if self._llama is not None:
            logits = self._llama(input_ids, position_ids, logits_index, ctx)
            assert logits is not None  # every layer ran (no num_layers): the logits are there
            return logits.float()  # [num_sampled, vocab]
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=logits_index,
            kv_context=ctx,
        )
        return out.logits[0].float()  # [num_sampled, vocab]

    # ------------------------------------------------------------------ KV in and out
    def precompute(
        self, token_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int], chunk_tokens: int
    ) -> None:
        """One causal pass over ``token_ids`` at RoPE ``positions``, writing token ``i``'s KV
        to ``slots[i]``; no logits. Runs in chunks of ``chunk_tokens``, each attending to the
        chunks before it (the keys already written), so the result is that of one pass."""
        for start in range(0, len(token_ids), chunk_tokens):
            self.precompute_chunk(token_ids, positions, slots, start, start + chunk_tokens)

    def precompute_chunk(
        self, token_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int], start: int, end: int
    ) -> None:
        """Tokens ``start..end`` of a ``precompute`` pass (one forward): they attend to the
        keys of tokens ``..start`` (already written) and causally to each other. Running the
        chunks of a pass one after another, at any time, gives exactly what ``precompute``
        with the same chunk size gives (a schema registered in slices between steps)."""
        # slices only: from_slots copies them into its own lists / arrays (no full-pass copy per chunk)
        self.execute(
            [
                SeqChunk.from_slots(
                    token_ids[start:end],
                    positions[start:end],
                    slots[start:end],
                    slots[:start],
                    positions[:start],
                    sample=False,
                )
            ]
        )

    def write_kv(self, slots: Sequence[int], kv: torch.Tensor, first_token: int = 0) -> None:
        """Write tokens ``first_token..`` of ``kv`` (``[layers, 2, tokens, kv_heads, row]``, the
        store's layout as ``read_kv`` gives it; a float pool takes any float dtype) into
        ``slots``, one per token. Raises ``ValueError`` (nothing written) when ``kv`` is not that
        shape (or, int8, not int8 rows) for this model and pool format."""
        layers, two, kv_heads, _, row = self.kv_cache.shape
        expected = (layers, two, first_token + len(slots), kv_heads, row)
        if tuple(kv.shape) != expected:
            raise ValueError(f"stored KV has shape {list(kv.shape)}, this model needs {list(expected)}")
        self.kv.write_rows(slots, kv[:, :, first_token:])

    def rope_shift(self) -> RopeShift:
        """The model's ``RopeShift`` (built once). Raises ``ValueError`` naming the rope type when
        its keys cannot be moved (documents are then refused before any work)."""
        if self._rope_shift is None:
            self._rope_shift = RopeShift.of(self.model)
        return self._rope_shift

    @torch.inference_mode()
    def copy_shifted(self, src_slots: np.ndarray, dst_slots: np.ndarray, delta: np.ndarray) -> None:
        """Copy the K/V of ``src_slots`` into ``dst_slots`` (each ``[n]`` int64), every key moved
        by ``delta`` (``[n]`` int64) RoPE positions (``engine/rope_shift.py``): one indexed read,
        one rotation, one indexed write for the whole batch. The two slot sets must not overlap."""
        shift = self.rope_shift()
        src = torch.from_numpy(np.ascontiguousarray(src_slots, dtype=np.int64)).to(self.device)  # [n]
        dst = torch.from_numpy(np.ascontiguousarray(dst_slots, dtype=np.int64)).to(self.device)  # [n]
        moves = torch.from_numpy(np.asarray(delta, dtype=np.int64))  # [n]
        self.kv.copy_shifted(src, dst, lambda k: shift.rotate(k, moves))  # k [layers, kv_heads, n, d]

    def read_kv(self, slots: Sequence[int]) -> torch.Tensor:
        """A CPU copy of the KV in ``slots`` as stored: ``[layers, 2, tokens, kv_heads, row]``
        (``row`` = head_dim values, or int8 rows with their scale: ``engine/kv_quant.py``)."""
        return self.kv.read_rows(slots)

    # ------------------------------------------------------------------ scratch passes
    @torch.inference_mode()
    def forward_by_position(
        self, token_ids: Sequence[int], positions: Sequence[int], through_layer: int
    ) -> torch.Tensor:
        """One pass over ``token_ids`` at RoPE ``positions``, each token attending to the tokens
        at or before its position, into a scratch KV tensor (the pool is only read): returns
        ``[depth, 2, kv_heads, n, head_dim]`` with token ``i``'s K/V at index ``i``, valid for
        layers ``0..through_layer`` (a plain Llama runs only those; other families run their
        whole forward, so ``depth`` is every layer there). No logits. ``engine/blend_pass.py``
        compares it with the cached KV."""
        n = len(token_ids)
        lay = self.layout
        depth = through_layer + 1 if self._llama is not None else lay.num_layers
        scratch = torch.zeros(depth, 2, lay.num_kv_heads, n, lay.head_dim, dtype=self.dtype, device=self.device)
        own = np.arange(n, dtype=np.int64)  # [n] scratch slot i holds token i
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)  # [n]
        # Positions rising in token order (documents, most plans) make "visible by position" the
        # plain causal mask: the causal kernel skips the hidden half the masked one computes.
        ordered = bool(np.all(pos[1:] > pos[:-1]))
        chunk = SeqChunk(
            list(token_ids), list(positions), KeyTable(own[:0], own, 1, n), None, False, by_position=not ordered
        )
        item = self._prefill_item(0, chunk) if ordered else self._positional_item(0, chunk)
        ctx = ForwardContext(scratch, torch.from_numpy(own).to(self.device), [item], None)
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, n]
        position_ids = torch.tensor([list(positions)], dtype=torch.long, device=self.device)  # [1, n]
        none = torch.zeros(0, dtype=torch.long, device=self.device)
        if self._llama is not None:
            self._llama(input_ids, position_ids, none, ctx, num_layers=depth)
        else:
            self.model(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=none, kv_context=ctx
            )
        return scratch

    def _positional_item(self, start: int, chunk: SeqChunk) -> PrefillItem:
        """A prefill item whose keys are visible by position: key ``j`` to new token ``i``
        iff ``pos[j] <= pos[i]`` (and inside the window on sliding layers). Context keys
        read where they were computed (``context_shifts``: documents in place) are grouped by
        frame, each group masked by position (``KeyFrames.by_position``)."""
        dev = self.device
        if chunk.keys.context_shifts is not None:
            if self.layout.sliding_windows:
                raise RuntimeError(
                    "model runner: keys by position over moved keys on a sliding-window model "
                    "(documents are copied there)"
                )
            own = np.zeros(chunk.keys.num_own, dtype=np.int64)  # the own keys' shift: computed where they are
            frames = KeyFrames.by_position(
                chunk.keys.slots(),
                np.concatenate((chunk.keys.context_shifts, own)),
                _key_positions(chunk),
                np.asarray(chunk.positions, dtype=np.int64),
                self.rope_shift(),
                self.dtype,
                dev,
            )
            return PrefillItem(start, len(chunk.token_ids), chunk.keys, None, {}, (), dev, masked=True, frames=frames)
        k_pos = torch.from_numpy(_key_positions(chunk)).to(dev)[None, :]  # [1, L]
        q_pos = torch.tensor(chunk.positions, dtype=torch.long, device=dev)[:, None]  # [n, 1]
        visible = k_pos <= q_pos  # [n, L]
        sliding = {w: visible & (k_pos > q_pos - w) for w in self.layout.sliding_windows}
        return PrefillItem(start, len(chunk.token_ids), chunk.keys, visible, sliding, (), dev, masked=True)

    # ------------------------------------------------------------------ masks
    def _prefill_item(self, start: int, chunk: SeqChunk) -> PrefillItem:
        dev = self.device
        n, c = len(chunk.token_ids), chunk.num_context
        if chunk.keys.context_shifts is not None:
            return self._frames_item(start, chunk)
        length = c + n
        q_idx = torch.arange(n, device=dev)[:, None] + c  # [n, 1] index of each query among keys
        k_idx = torch.arange(length, device=dev)[None, :]  # [1, L]
        causal = k_idx <= q_idx  # [n, L]
        mask_full = None if c == 0 else causal
        mask_sliding: dict[int, torch.Tensor | None] = {}
        if self.layout.sliding_windows:
            k_pos = torch.from_numpy(_key_positions(chunk)).to(dev)[None, :]  # [1, L]
            q_pos = torch.tensor(chunk.positions, dtype=torch.long, device=dev)[:, None]  # [n, 1]
            for window in self.layout.sliding_windows:
                if c == 0 and chunk.positions[-1] - chunk.positions[0] < window:
                    mask_sliding[window] = None  # the window never cuts (positions may have gaps): plain causal
                else:
                    mask_sliding[window] = causal & (k_pos > q_pos - window)
        # Without sliding windows every context key is visible to every new token and its
        # position is already inside K, so the order keys are read in does not matter:
        # reading them in slot order merges runs (modules precomputed side by side become
        # one run, whatever order a prompt lists them in). Masked layers need attention order,
        # and so does deterministic mode: its kernels cut the keys into items of 256 in
        # attention order, so another order rounds differently (a hit whose blocks came back
        # from the host tier into other slots gave another answer than the miss).
        in_slot_order = not self.layout.sliding_windows and not self.deterministic
        runs = _key_runs(chunk.keys, n, slot_order=in_slot_order)
        return PrefillItem(start, n, chunk.keys, mask_full, mask_sliding, runs, dev)

    def _frames_item(self, start: int, chunk: SeqChunk) -> PrefillItem:
        """A prefill item whose context keys lie in several RoPE frames (documents read where
        they were computed): every context key visible to every new token, the new tokens
        causal among themselves (a lone decode token's own key joins the groups). Refused on
        models with sliding-window layers (their masks need keys in one frame)."""
        if self.layout.sliding_windows:
            raise RuntimeError(
                "model runner: moved keys on a model with sliding-window layers (documents are copied there)"
            )
        keys, n = chunk.keys, len(chunk.token_ids)
        own_end = keys.num_own if n == 1 else keys.num_own - n  # own keys the groups hold
        own_starts, own_lengths = keys.own_intervals(0, own_end)
        assert keys.context_shifts is not None  # only moved keys (documents in place) come here
        frames = KeyFrames.build(
            keys.context_slots, keys.context_shifts, own_starts, own_lengths, self.rope_shift(), self.device
        )
        return PrefillItem(start, n, keys, None, {}, (), self.device, frames=frames)

    def _decode_batch(self, rows: list[tuple[int, SeqChunk]]) -> DecodeBatch:
        dev = self.device
        lengths = [c.keys.num_keys for _, c in rows]
        lmax = max(lengths)
        slots = np.zeros((len(rows), lmax), np.int64)  # [B, Lmax]
        for i, (_, c) in enumerate(rows):
            slots[i, : lengths[i]] = c.keys.slots()
        lens = torch.tensor(lengths, device=dev)
        valid = torch.arange(lmax, device=dev)[None, :] < lens[:, None]  # [B, Lmax]
        mask_sliding: dict[int, torch.Tensor] = {}
        if self.layout.sliding_windows:
            k_pos_rows = np.zeros((len(rows), lmax), np.int64)  # [B, Lmax]
            for i, (_, c) in enumerate(rows):
                k_pos_rows[i, : lengths[i]] = _key_positions(c)
            k_pos = torch.from_numpy(k_pos_rows).to(dev)  # [B, Lmax]
            q_pos = torch.tensor([c.positions[0] for _, c in rows], device=dev)[:, None]  # [B, 1]
            for window in self.layout.sliding_windows:
                mask_sliding[window] = (valid & (k_pos > q_pos - window))[:, None, None, :]
        return DecodeBatch(
            token_index=torch.tensor([start for start, _ in rows], dtype=torch.long, device=dev),
            kv_slots=torch.from_numpy(slots).to(dev),  # [B, Lmax]
            mask_full=valid[:, None, None, :],  # [B, 1, 1, Lmax]
            mask_sliding=mask_sliding,
        )


def _key_positions(chunk: SeqChunk) -> np.ndarray:
    """``[num_keys]`` int64 RoPE positions of every key of ``chunk``, the new tokens last."""
    c = chunk.num_context
    before = chunk.context_positions if chunk.context_positions is not None else np.arange(c, dtype=np.int64)
    return np.concatenate((before, np.asarray(chunk.positions, dtype=np.int64)))


MAX_RUNS = 32  # more pieces than this and one gather is cheaper than many small matmuls
DECODE_IN_PLACE_MIN = 1024  # context tokens from which a decode skips the gathered batch


def _runs(slots: list[int] | np.ndarray) -> tuple[tuple[int, int], ...]:
    """``slots`` as (first slot, length) runs of consecutive slots; ``()`` if more than MAX_RUNS."""
    arr = np.asarray(slots, dtype=np.int64).reshape(-1)  # [L]
    return _as_runs(*_merge_intervals(arr, np.ones_like(arr)))


def _key_runs(keys: KeyTable, num_new: int, *, slot_order: bool) -> tuple[tuple[int, int], ...]:
    """The keys of ``keys`` as (first slot, length) runs, in read order: the keys before the
    ``num_new`` new tokens sorted by slot when ``slot_order`` (else attention order), then
    the new tokens; ``()`` if more than MAX_RUNS. Works per block, not per token: equal to
    ``_runs`` of the read order's slots."""
    ctx = keys.context_slots
    before = keys.num_own - num_new  # own tokens before the new ones
    if slot_order:
        starts, lengths = keys.own_intervals(0, before)
        starts = np.concatenate((ctx, starts))  # [c + blocks]
        lengths = np.concatenate((np.ones_like(ctx), lengths))
        order = np.argsort(starts, kind="stable")  # the intervals are disjoint: this sorts the slots
        new_starts, new_lengths = keys.own_intervals(before, keys.num_own)
        starts = np.concatenate((starts[order], new_starts))
        lengths = np.concatenate((lengths[order], new_lengths))
    else:
        own_starts, own_lengths = keys.own_intervals(0, keys.num_own)
        starts = np.concatenate((ctx, own_starts))
        lengths = np.concatenate((np.ones_like(ctx), own_lengths))
    return _as_runs(*_merge_intervals(starts, lengths))


def _merge_intervals(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Intervals (``[k]`` first slots, ``[k]`` lengths, in read order) with each one that
    continues the one before merged into it; empty intervals dropped."""
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]  # [k']
    if not len(starts):
        return starts, lengths
    opens = np.ones(len(starts), dtype=bool)  # [k'] True where a new run begins
    opens[1:] = starts[1:] != starts[:-1] + lengths[:-1]
    first = np.flatnonzero(opens)  # [runs]
    return starts[first], np.add.reduceat(lengths, first)


def _as_runs(starts: np.ndarray, lengths: np.ndarray) -> tuple[tuple[int, int], ...]:
    """Merged intervals as ``((first slot, length), ...)``; ``()`` if more than MAX_RUNS."""
    if len(starts) > MAX_RUNS:
        return ()
    return tuple(zip(starts.tolist(), lengths.tolist()))
