"""The running batch of a continuously batched decoder: each row one request's KV cache, kept
between steps, joined by a prompt run alone and left when its request ends.

Two stores, by the decoder's cache form (the file's ``kv_cache`` record):

- :class:`SharedRows`, for ``--kv-cache shared`` fusions with per-row lengths (each buffer
  row holds its row's kept keys first, rewrite/lower/rows.py): one buffer per past of
  ``[slots, kv_heads, max_length, head]`` allocated (and written through) once. The running
  rows sit in the first slots; a step binds a view of the first ``rows`` slots as both past
  and present (ORT writes each row's new position in place, at its own length). A prompt
  runs alone at batch 1 on a view of the next free slot, so that a joining row's cache is
  written where it stays; a row that leaves gives its slot to the last row (its cached
  positions copied), so that the running rows stay in one block.
- :class:`AppendedRows`, for appended caches: the rows' caches left-padded to one length
  (the mask 0 on padding, as ``generate`` pads a batch); a joining row's cache is padded in
  (one copy of the batch's cache), a leaving row's removed and the columns no row keeps any
  more dropped.

Either way each row's step reads its own positions only: its tokens equal the same request
generated alone (the prompt run is the same run; a step's rows are independent).
"""

from __future__ import annotations

import numpy as np

from mha_onnx.errors import ModelFileError
from mha_onnx.generate.decode import GUARD
from mha_onnx.generate.loop import Generator
from mha_onnx.graph.cache import LENGTH_INPUT
from mha_onnx.graph.decoder import IDS, LOGITS, MASK, POSITIONS


def _run(session, binding) -> None:
    try:
        session.run_with_iobinding(binding)
    except Exception as exc:  # ORT's own errors are one request's failure, not the server's
        if type(exc).__module__.startswith("onnxruntime"):
            raise ModelFileError(f"onnxruntime failed to run the model: "
                                 f"{' '.join(str(exc).split())[:300]}") from exc
        raise


class _Rows:
    """What both stores share: the generator's sessions, the feeds' dtypes and the logits."""

    def __init__(self, generator: Generator, slots: int) -> None:
        self.generator, self.iface, self.slots = generator, generator.interface, slots
        self.session = generator.runner.session
        self.steps_only = generator.steps_only
        self.order: list[int] = []  # row ids, in batch order
        self.length: dict[int, int] = {}  # row id -> its cached (kept) positions
        self.pending: dict[int, int] = {}  # row id -> prompt positions run (not yet joined)
        self.guard = np.zeros((), np.bool_)
        kind = next(o.type for o in self.session.get_outputs() if o.name == LOGITS)
        self.logits_dtype = np.float16 if kind == "tensor(float16)" else np.float32
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.mixer = None  # a runner of a step and a chunk in one run (mixed.py), or None

    @property
    def rows(self) -> int:
        return len(self.order)

    def free(self) -> int:
        return self.slots - len(self.order) - len(self.pending)

    def join(self, row: int, prompt: list[int]) -> np.ndarray:
        """Runs ``prompt`` alone (one run) and the row joins the batch; its last logits."""
        return self.prefill(row, prompt, len(prompt))

    def prefill(self, row: int, prompt: list[int], upto: int) -> np.ndarray | None:
        """Runs ``prompt``'s next positions, up to ``upto``, for ``row`` (not in the batch
        until its whole prompt has run: then it joins, and its last logits come back; None
        before). The first run has no past; the next ones run after what the row holds."""
        done = self._done(row, prompt, upto)
        logits = self._prompt_run(row, prompt[done:upto], done)
        return logits if self._ran(row, prompt, upto) else None

    def _done(self, row: int, prompt: list[int], upto: int) -> int:
        """The positions of ``row``'s prompt run so far, checked against the next run's end."""
        done = self.pending.get(row, 0)
        if not 0 <= done < upto <= len(prompt):
            raise ValueError(f"row {row}: positions {done}..{upto} of {len(prompt)}")
        return done

    def _ran(self, row: int, prompt: list[int], upto: int) -> bool:
        """``row``'s prompt has run up to ``upto``: at its end the row joins the batch (True)."""
        if upto < len(prompt):
            self.pending[row] = upto
            return False
        self.pending.pop(row, None)
        self._joined(row, len(prompt))
        return True

    def abort(self, row: int) -> None:
        """A row whose prompt had not run to its end: its place freed."""
        self.pending.pop(row, None)
        self._aborted(row)

    def _feeds(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> dict:
        dtypes = self.iface.dtypes
        feeds = {IDS: ids, MASK: mask, POSITIONS: positions}
        return {k: np.ascontiguousarray(v, dtype=dtypes[k]) for k, v in feeds.items()
                if k in dtypes}

    def _prompt_session(self, tokens: int):
        """The session a prompt of ``tokens`` runs through, as ``generate`` picks it."""
        return self.generator._prompt_session(tokens) or self.session

    def _check_guard(self, session) -> None:
        if session is self.session and self.steps_only and not self.guard:
            raise ModelFileError("a step the decode graph does not admit (its guard is false)",
                                 hint="serve with --prompt-as-written (the file as written)")


class SharedRows(_Rows):
    """Rows of shared per-row buffers (module doc)."""

    def __init__(self, generator: Generator, slots: int, max_length: int) -> None:
        super().__init__(generator, slots)
        iface = self.iface
        self.max_length = max_length
        # written through once here (np.full, not np.zeros' untouched pages): a slot's first
        # prompt run would otherwise take its page faults, several times a later run's time,
        # in the gap every running stream waits through
        self.buffers = {past: np.full((slots, iface.kv_heads_of(past), max_length,
                                       iface.head_of(past)), 0, iface.kv_dtype)
                        for past, _ in iface.pasts}
        self.presents = dict(iface.pasts)
        self.step_logits: dict[int, np.ndarray] = {}
        self._slots: dict[int, int] = {}  # prefilling row -> its slot

    @property
    def cache_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def _bind_cache(self, binding, first: int, rows: int, named=lambda name: name) -> None:
        """Slots ``[first, first + rows)`` of every buffer as past and present (the inputs
        and outputs ``named`` gives of each past's and present's name)."""
        for past, buffer in self.buffers.items():
            shape = [rows, *buffer.shape[1:]]
            address = buffer.ctypes.data + first * buffer.strides[0]
            binding.bind_input(named(past), "cpu", 0, buffer.dtype, shape, address)
            binding.bind_output(named(self.presents[past]), "cpu", 0, buffer.dtype, shape,
                                address)

    def _bind_outputs(self, session, binding, logits: np.ndarray) -> None:
        for name in (o.name for o in session.get_outputs()):
            if name == LOGITS:
                binding.bind_output(name, "cpu", 0, logits.dtype, list(logits.shape),
                                    logits.ctypes.data)
            elif name == GUARD:
                binding.bind_output(name, "cpu", 0, np.bool_, [], self.guard.ctypes.data)
            elif name not in self.presents.values():
                binding.bind_output(name, "cpu", 0)

    def _prompt_run(self, row: int, chunk: list[int], past: int) -> np.ndarray:
        """``chunk`` after ``past`` positions of ``row``, at batch 1 in the slot after the
        running rows (where it joins); its last logits (float32 [vocab])."""
        n, total = len(chunk), past + len(chunk)
        session = self._prompt_session(n)
        binding = session.io_binding()
        feeds = self._feeds(np.array([chunk]), np.ones((1, total)),
                            np.arange(past, total)[None])
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        if self.iface.length_input:
            binding.bind_cpu_input(LENGTH_INPUT, np.array(past, np.int64))
        self._bind_cache(binding, self._slot_of(row), 1)
        logits = np.empty((1, 1 if self.iface.last_logits else n, self.iface.vocab),
                          self.logits_dtype)
        self._bind_outputs(session, binding, logits)
        _run(session, binding)
        self._check_guard(session)
        return logits[0, -1].astype(np.float32)

    def _slot_of(self, row: int) -> int:
        """A prefilling row's slot: after the running rows and the other prefilling ones."""
        if row not in self._slots:
            taken = set(self._slots.values())
            self._slots[row] = next(s for s in range(len(self.order), self.slots)
                                    if s not in taken)
        return self._slots[row]

    def _joined(self, row: int, length: int) -> None:
        """The row takes the slot after the running rows (rows that left while it prefilled
        moved it down; another prefilling row there swaps with it)."""
        slot, target = self._slots.pop(row), len(self.order)
        other = next((r for r, at in self._slots.items() if at == target), None)
        if other is not None:
            for buffer in self.buffers.values():
                buffer[[slot, target]] = buffer[[target, slot]]
            self._slots[other] = slot
        elif slot != target:
            self._move(slot, target, length)
        self.order.append(row)
        self.length[row] = length

    def _aborted(self, row: int) -> None:
        self._slots.pop(row, None)

    def _move(self, source: int, target: int, length: int) -> None:
        for buffer in self.buffers.values():
            buffer[target, :, :length] = buffer[source, :, :length]

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """One new token per row (in batch order) -> float32 [rows, vocab]."""
        rows = len(self.order)
        n = np.array([self.length[r] for r in self.order], np.int64)
        width = int(n.max()) + 1
        mask = np.arange(width)[None, :] >= (width - 1 - n)[:, None]  # each row's kept last
        feeds = self._feeds(tokens[:, None], mask, n[:, None])
        binding = self.session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        if self.iface.length_input:
            binding.bind_cpu_input(LENGTH_INPUT, np.array(width - 1, np.int64))
        self._bind_cache(binding, 0, rows)
        if rows not in self.step_logits:
            self.step_logits[rows] = np.empty((rows, 1, self.iface.vocab), self.logits_dtype)
        logits = self.step_logits[rows]
        self._bind_outputs(self.session, binding, logits)
        _run(self.session, binding)
        self._check_guard(self.session)
        for r in self.order:
            self.length[r] += 1
        return logits[:, 0].astype(np.float32)

    def mixed(self, tokens: np.ndarray, row: int, prompt: list[int], upto: int
              ) -> tuple[np.ndarray, np.ndarray | None]:
        """One step of the running rows (``tokens``, in batch order) and ``row``'s prompt
        positions up to ``upto`` in one run of the mixed graph (serve/mixed.py): the step's
        float32 [rows, vocab] logits, and the row's last logits once its prompt has run (it
        joins then; None before)."""
        from mha_onnx.serve import mixed as mx

        done = self._done(row, prompt, upto)
        rows, n = len(self.order), np.array([self.length[r] for r in self.order], np.int64)
        session = self.mixer.session
        dtypes = self.iface.dtypes
        feeds = {IDS: np.concatenate([tokens, prompt[done:upto]])[None].astype(dtypes[IDS]),
                 POSITIONS: np.concatenate([n, np.arange(done, upto)])[None].astype(
                     dtypes[POSITIONS]),
                 mx.STEP_LENGTHS: n.astype(np.int32), mx.STEP_TOTAL: np.array(
                     n.max() + 1, np.int32), mx.CHUNK_LENGTHS: np.array([upto - 1], np.int32),
                 mx.CHUNK_TOTAL: np.array(upto, np.int32),
                 mx.LAST: np.append(np.arange(rows), rows + upto - done - 1).astype(np.int64)}
        binding = session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        self._bind_cache(binding, 0, rows)
        self._bind_cache(binding, self._slot_of(row), 1, mx.chunk_name)
        logits = np.empty((1, rows + 1, self.iface.vocab), self.logits_dtype)
        binding.bind_output(LOGITS, "cpu", 0, logits.dtype, list(logits.shape),
                            logits.ctypes.data)  # (its other outputs: the presents, bound)
        _run(session, binding)
        for r in self.order:
            self.length[r] += 1
        step = logits[0, :rows].astype(np.float32)
        return step, logits[0, rows].astype(np.float32) if self._ran(row, prompt, upto) else None

    def leave(self, row: int) -> None:
        """The row's slot given to the last row (its cached positions copied)."""
        slot, last = self.order.index(row), len(self.order) - 1
        if slot != last:
            moved = self.order[last]
            self._move(last, slot, self.length[moved])
            self.order[slot] = moved
        self.order.pop()
        del self.length[row]


class AppendedRows(_Rows):
    """Rows of appended caches, left-padded to one length (module doc)."""

    def __init__(self, generator: Generator, slots: int) -> None:
        super().__init__(generator, slots)
        iface = self.iface
        self.cache: dict[str, object] = {}  # past -> [rows, kv, P, D] (numpy or OrtValue)
        self.kept = np.zeros((0, 0), bool)  # [rows, P]: the positions each row keeps
        self.empty = {past: np.zeros((1, iface.kv_heads_of(past), 0, iface.head_of(past)),
                                     iface.kv_dtype) for past, _ in iface.pasts}
        self._own: dict[int, dict] = {}  # prefilling row -> its presents so far

    @property
    def cache_bytes(self) -> int:
        return sum(int(np.prod(self._shape(v))) * np.dtype(self.iface.kv_dtype).itemsize
                   for v in self.cache.values())

    @staticmethod
    def _shape(value) -> tuple[int, ...]:
        return tuple(value.shape() if callable(getattr(value, "shape", None)) else value.shape)

    def _run(self, session, feeds: dict, pasts: dict, past_length: int
             ) -> tuple[np.ndarray, dict]:
        """One run; (its logits, past -> present OrtValue)."""
        binding = session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        for name, value in pasts.items():
            if isinstance(value, np.ndarray):
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
            else:
                binding.bind_ortvalue_input(name, value)
        if self.iface.length_input:
            binding.bind_cpu_input(LENGTH_INPUT, np.array(past_length, np.int64))
        for name in (o.name for o in session.get_outputs()):
            if name == GUARD:
                binding.bind_output(name, "cpu", 0, np.bool_, [], self.guard.ctypes.data)
            else:
                binding.bind_output(name, "cpu", 0)
        _run(session, binding)
        self._check_guard(session)
        values = dict(zip([o.name for o in session.get_outputs()], binding.get_outputs(),
                          strict=True))
        presents = {past: values[present] for past, present in self.iface.pasts}
        return values[LOGITS].numpy()[:, -1].astype(np.float32), presents

    def _prompt_run(self, row: int, chunk: list[int], past: int) -> np.ndarray:
        """``chunk`` after the row's own ``past`` positions, at batch 1 (its presents kept
        apart until it joins)."""
        n, total = len(chunk), past + len(chunk)
        feeds = self._feeds(np.array([chunk]), np.ones((1, total)),
                            np.arange(past, total)[None])
        logits, self._own[row] = self._run(self._prompt_session(n), feeds,
                                           self._own.get(row, self.empty), past)
        return logits[0]

    def _aborted(self, row: int) -> None:
        self._own.pop(row, None)

    def _joined(self, row: int, n: int) -> None:
        """The row's cache padded into the batch's (module doc)."""
        presents = self._own.pop(row)
        width = max(self.kept.shape[1], n)
        kept = np.zeros((len(self.order) + 1, width), bool)
        kept[:-1, width - self.kept.shape[1]:] = self.kept
        kept[-1, width - n:] = True
        for past in self.empty:
            new = presents[past].numpy()
            old = self._array(past)
            merged = np.zeros((kept.shape[0], *new.shape[1:2], width, new.shape[3]), new.dtype)
            if old is not None:
                merged[:-1, :, width - old.shape[2]:] = old
            merged[-1, :, width - n:] = new[0]
            self.cache[past] = merged
        self.kept = kept
        self.order.append(row)
        self.length[row] = n

    def _array(self, past: str) -> np.ndarray | None:
        value = self.cache.get(past)
        if value is None or isinstance(value, np.ndarray):
            return value
        return value.numpy()

    def step(self, tokens: np.ndarray) -> np.ndarray:
        n = np.array([self.length[r] for r in self.order], np.int64)
        kept = np.concatenate([self.kept, np.ones((len(n), 1), bool)], axis=1)
        feeds = self._feeds(tokens[:, None], kept, n[:, None])
        logits, presents = self._run(self.session, feeds, self.cache, self.kept.shape[1])
        self.cache, self.kept = presents, kept
        for r in self.order:
            self.length[r] += 1
        return logits

    def leave(self, row: int) -> None:
        index = self.order.index(row)
        keep = np.ones(len(self.order), bool)
        keep[index] = False
        self.kept = self.kept[keep]
        used = np.flatnonzero(self.kept.any(axis=0))
        first = int(used[0]) if used.size else self.kept.shape[1]
        self.kept = self.kept[:, first:]
        self.cache = {past: self._array(past)[keep][:, :, first:] for past in self.empty}
        self.order.pop(index)
        del self.length[row]
