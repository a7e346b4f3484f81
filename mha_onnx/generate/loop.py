"""The generation loop over ONNX Runtime: a prompt run, then one token per step, as
production runs a decoder.

Each run goes through one IO binding: the cache never passes through numpy (an appended
cache's presents are bound as the next step's pasts as ORT returned them; a shared cache is
one buffer per past, bound as both past and present and written in place), and the logits
are written by ORT into arrays allocated once, of which only each row's last position is
read. Rows are left-padded to the longest prompt (``prompt_feeds``), as transformers pads
for generation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mha_onnx.errors import ConfigError, ModelFileError
from mha_onnx.generate.decode import GUARD
from mha_onnx.generate.genai_file import GENAI_RECORD
from mha_onnx.generate.prompt import PROMPT_ROWS, sessions
from mha_onnx.generate.result import GenerationConfig, GenerationResult
from mha_onnx.generate.sampling import next_tokens
from mha_onnx.graph import metadata
from mha_onnx.graph.cache import LENGTH_INPUT, device_of
from mha_onnx.graph.decoder import IDS, LOGITS, MASK, POSITIONS, DecoderInterface


def prompt_feeds(prompts: Sequence[Sequence[int]], interface: DecoderInterface,
                 pad: int) -> dict[str, np.ndarray]:
    """The prompt run's inputs: ids left-padded with ``pad`` to the longest prompt, the mask
    (0 on padding), positions counted over each row's kept tokens (1 on padding, as
    transformers fills them; never read)."""
    batch, longest = len(prompts), max(len(p) for p in prompts)
    ids = np.full((batch, longest), pad, np.int64)
    mask = np.zeros((batch, longest), np.int64)
    for b, prompt in enumerate(prompts):
        ids[b, longest - len(prompt):] = prompt
        mask[b, longest - len(prompt):] = 1
    positions = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 1)
    feeds = {IDS: ids, MASK: mask, POSITIONS: positions}
    return {k: v.astype(interface.dtypes[k]) for k, v in feeds.items() if k in interface.dtypes}


class Generator:
    """A decoder file and one ONNX Runtime session for it; :meth:`generate` runs a batch."""

    def __init__(self, model: str | Path, *, provider: str = "cpu", threads: int | None = None,
                 interface: DecoderInterface | None = None,
                 float_prompt: bool | None = None, quiet: bool = False) -> None:
        """``float_prompt``: a quantized file's long prompts in float compute (prompt.py;
        None: where the CPU has no int8 dot-product instructions); False: every run through
        the file as written, one session. ``quiet``: the session's pool threads do not spin
        past a run (another session runs between its runs: serve's mixed steps)."""
        from mha_onnx.graph.decoder import read_interface
        from mha_onnx.graph.files import read_model
        from mha_onnx.graph.metadata import session_options
        from mha_onnx.runtime.ort import OrtRunner

        proto = read_model(model, load_external_data=False)
        self.path = Path(model)
        self.genai_of = (metadata.loaded(proto, GENAI_RECORD) or {}).get("of")
        self.interface = interface or read_interface(proto, model)
        level = session_options(proto).get("optimization", "all")
        made, steps = sessions(model, proto, self.interface.shared,
                               provider == "cpu" and float_prompt is not False, float_prompt)
        shared = made.initializers if made else {}
        # with a second session, neither's pool threads spin past its runs: they would take
        # the cores from the other's (a 128-token prompt 1.3x slower after steps, AMD EPYC;
        # 1.45x after a decode graph's steps whose threads spun on)
        self.runner = OrtRunner(str(model) if steps is None else steps.SerializeToString(),
                                provider, threads=threads, optimization=level,
                                initializers=shared, stop_spinning=made is not None or quiet,
                                external_data_dir=None if steps is None else made.folder)
        if steps is not None:
            self.runner.session  # noqa: B018 (made now, then the bytes let go)
            self.runner.model = b""
        self.steps_only = steps is not None
        self.prompt_runner: OrtRunner | None = None  # (made on the first long prompt)
        self._threads, self._level = threads, level
        self.float_prompt = made
        self.device = device_of(provider)

    def close(self) -> None:
        self.runner.close()
        if self.prompt_runner is not None:
            self.prompt_runner.close()

    def _prompt_session(self, rows: int) -> Any:
        """The float prompt's session (prompt.py) for a prompt of ``rows`` tokens, or None."""
        from mha_onnx.runtime.ort import OrtRunner

        made = self.float_prompt
        if made is None or (rows < PROMPT_ROWS and not self.steps_only):
            return None  # (a short prompt runs as written, unless the steps' graph cannot)
        if self.prompt_runner is None:
            self.prompt_runner = OrtRunner(made.model, "cpu", threads=self._threads,
                                           optimization=self._level,
                                           initializers=made.initializers,
                                           stop_spinning=True, external_data_dir=made.folder)
            self.prompt_runner.session  # noqa: B018 (made now, then the bytes let go)
            self.prompt_runner.model = made.model = b""
        return self.prompt_runner.session

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check(self, prompts: Sequence[Sequence[int]], config: GenerationConfig) -> int:
        """Refuses what the model cannot run; returns the buffers' length."""
        iface = self.interface
        if not prompts:
            raise ConfigError("no prompts given", hint="--prompts takes a JSON list of token-id "
                                                       "lists, e.g. [[1, 2, 3], [4, 5]]")
        for n, prompt in enumerate(prompts):
            if not len(prompt):
                raise ConfigError(f"prompt {n} is empty", hint="every prompt needs a token")
            bad = [t for t in prompt if not 0 <= int(t) < iface.vocab]
            if bad:
                raise ConfigError(f"prompt {n} has token id(s) outside the vocabulary of "
                                  f"{iface.vocab}: {bad[:5]}", hint="ids are 0..vocab-1")
        longest = max(len(p) for p in prompts)
        if self.genai_of and min(len(p) for p in prompts) < longest:
            raise ConfigError(f"{self.path.name} is the file ONNX Runtime GenAI runs (no If: "
                              "its prompts right-padded, as GenAI pads them); generate pads "
                              "a batch of unequal prompts on the left, which it does not take",
                              hint=f"run {self.genai_of} beside it (the file as written), or "
                                   "prompts of one length")
        needed = longest + config.max_new_tokens
        capacity = config.max_length or needed
        if needed > capacity:
            raise ConfigError(f"the longest prompt ({longest} tokens) and --max-new-tokens "
                              f"{config.max_new_tokens} need {needed} positions, more than "
                              f"--max-length {capacity}",
                              hint="raise --max-length or shorten the prompts")
        if iface.position_limit is not None and needed > iface.position_limit:
            raise ConfigError(f"the longest prompt ({longest} tokens) and --max-new-tokens "
                              f"{config.max_new_tokens} go past the model's position table "
                              f"of {iface.position_limit} positions",
                              hint="shorten the prompts or generate fewer tokens")
        # a rotary model has no table to run past, but it was trained to its context only
        if iface.context_length and needed > iface.context_length:
            raise ConfigError(f"the longest prompt ({longest} tokens) and --max-new-tokens "
                              f"{config.max_new_tokens} go past the model's context of "
                              f"{iface.context_length} positions (max_position_embeddings)",
                              hint="shorten the prompts or generate fewer tokens")
        return capacity

    def generate(self, prompts: Sequence[Sequence[int]], config: GenerationConfig,
                 on_step: Callable[[int, int], None] | None = None) -> GenerationResult:
        """Generate for every prompt (one batch); ``on_step(done, total)`` after each run."""
        capacity = self.check(prompts, config)
        iface = self.interface
        eos = iface.tokens.eos if config.eos is None else tuple(config.eos)
        pad = iface.tokens.pad if iface.tokens.pad is not None else (eos[0] if eos else 0)
        rng = np.random.default_rng(config.sampling.seed)
        feeds = prompt_feeds(prompts, iface, pad)
        run = _BoundRuns(self.runner.session, iface, len(prompts), capacity, self.device,
                         self._prompt_session(feeds[IDS].shape[1]), self.steps_only)
        started = time.perf_counter()
        logits = run(feeds, new=feeds[IDS].shape[1], past=0)
        token = next_tokens(logits, config.sampling, rng)
        first = time.perf_counter()
        batch = len(prompts)
        out: list[list[int]] = [[] for _ in range(batch)]
        stopped = ["length"] * batch
        live = np.ones(batch, bool)
        width = feeds[IDS].shape[1]
        mask = np.ones((batch, width + config.max_new_tokens), np.int64)  # padding kept 0
        if MASK in feeds:
            mask[:, :width] = feeds[MASK]
        kept = np.array([len(p) for p in prompts], np.int64)  # the next token's position
        steps = 0
        for step in range(config.max_new_tokens):
            for b in np.flatnonzero(live):
                out[b].append(int(token[b]))
                if int(token[b]) in eos:
                    live[b], stopped[b] = False, "eos"
            if on_step is not None:
                on_step(step + 1, config.max_new_tokens)
            if step + 1 == config.max_new_tokens or not live.any():
                break
            width += 1
            feeds = {IDS: token[:, None], MASK: mask[:, :width],
                     POSITIONS: kept[:, None]}
            feeds = {k: v.astype(iface.dtypes[k], copy=False) for k, v in feeds.items()
                     if k in iface.dtypes}
            logits = run(feeds, new=1, past=width - 1)
            token = next_tokens(logits, config.sampling, rng)
            kept += 1
            steps += 1
        done = time.perf_counter()
        return GenerationResult(
            sequences=tuple(tuple(s) for s in out),
            prompt_lengths=tuple(len(p) for p in prompts), stopped=tuple(stopped),
            time_to_first_token_ms=1e3 * (first - started), seconds=done - started,
            steps=steps, decode_seconds=done - first, ort_seconds=run.ort_seconds,
            interface=iface, eos=eos, sampling=config.sampling,
            notes=tuple(_notes(iface, eos, config, run.float_prompts and self.float_prompt,
                               self.steps_only and steps > 0)))


def _notes(iface: DecoderInterface, eos: tuple[int, ...], config: GenerationConfig,
           floated: Any = None, steps_only: bool = False) -> list[str]:
    notes = []
    if not eos and config.eos is None:
        notes.append("the model names no end-of-sequence token inside its vocabulary: every "
                     "row ran --max-new-tokens (give --eos ID)")
    if floated:
        levels = "/".join(map(str, floated.levels))
        notes.append(f"the prompt ran with the MatMulNBits in float compute (accuracy level 1; "
                     f"the steps at the file's level {levels})"
                     + ("" if steps_only else f": faster from {PROMPT_ROWS} tokens on a CPU "
                                              "without int8 dot-product instructions"))
    if steps_only:
        notes.append("the steps ran the fusion's fast form alone (its run-time If taken apart, "
                     "its guard checked after each step; --prompt-as-written runs the file as "
                     "written)")
    return notes


class _BoundRuns:
    """One IO binding over the whole generation: the cache handed from run to run without a
    copy, the logits written into arrays allocated here; returns each row's last logits."""

    def __init__(self, session: Any, iface: DecoderInterface, batch: int, capacity: int,
                 device: str, prompt: Any = None, steps_only: bool = False) -> None:
        """``steps_only``: ``session`` is a decode graph (decode.py): every prompt runs
        through ``prompt``, and each step's guard output is read."""
        import onnxruntime as ort

        self.ort, self.session, self.iface = ort, session, iface
        self.prompt, self.float_prompts = prompt, 0  # (prompt.py's session, its runs)
        self.steps_only, self.guard = steps_only, np.zeros((), np.bool_)
        self.binding = session.io_binding()
        self.device, self.batch, self.ort_seconds = device, batch, 0.0
        self.outputs = [o.name for o in session.get_outputs()]
        self.presents = {present: past for past, present in iface.pasts}
        length = capacity if iface.shared else 0
        self.cache = {past: ort.OrtValue.ortvalue_from_numpy(
            np.zeros((batch, iface.kv_heads_of(past), length, iface.head_of(past)),
                     iface.kv_dtype),
            device, 0) for past, _ in iface.pasts}
        self.logits: dict[int, np.ndarray] = {}
        self.dtype = np.dtype(_output_dtype(session, LOGITS))
        self.bound_rows = 0  # the logits buffer the binding holds (its rows), 0: none yet

    def _logits_buffer(self, rows: int) -> np.ndarray:
        if rows not in self.logits:  # a prompt's [B, S, V] once, a step's [B, 1, V] reused
            self.logits = {k: v for k, v in self.logits.items() if k == 1}
            self.logits[rows] = np.empty((self.batch, rows, self.iface.vocab), self.dtype)
        return self.logits[rows]

    def __call__(self, feeds: dict[str, np.ndarray], new: int, past: int) -> np.ndarray:
        if self.prompt is not None and (new >= PROMPT_ROWS or (self.steps_only and not past)):
            self.float_prompts += 1
            return self._run(self.prompt, self.prompt.io_binding(), feeds, new, past, 0)[0]
        logits, self.bound_rows = self._run(self.session, self.binding, feeds, new, past,
                                            self.bound_rows)
        return logits

    def _run(self, session: Any, binding: Any, feeds: dict[str, np.ndarray], new: int,
             past: int, bound_rows: int) -> tuple[np.ndarray, int]:
        """One run of ``session`` through ``binding`` (its outputs bound for ``bound_rows``
        rows of logits, 0: none yet); (each row's last logits, the rows now bound)."""
        iface = self.iface
        held = [np.ascontiguousarray(v) for v in feeds.values()]  # alive until the run
        for name, value in zip(feeds, held, strict=True):
            binding.bind_cpu_input(name, value)
        if iface.length_input:
            held.append(np.array(past, np.int64))
            binding.bind_cpu_input(LENGTH_INPUT, held[-1])
        logits = self._logits_buffer(1 if iface.last_logits else new)
        if not iface.shared or not bound_rows:  # (a shared cache: bound once)
            for name, value in self.cache.items():
                binding.bind_ortvalue_input(name, value)
        if bound_rows != logits.shape[1] or not iface.shared:
            for name in self.outputs:  # in the session's order
                if name == LOGITS:
                    binding.bind_output(name, "cpu", 0, self.dtype, list(logits.shape),
                                        logits.ctypes.data)
                elif name in self.presents and iface.shared:
                    binding.bind_ortvalue_output(name, self.cache[self.presents[name]])
                elif name == GUARD:  # (the decode graph's alone, not the prompt's)
                    if session is self.session:
                        binding.bind_output(name, "cpu", 0, np.bool_, [],
                                            self.guard.ctypes.data)
                else:  # ORT allocates them (an appended cache's presents: every run anew)
                    binding.bind_output(name, self.device, 0)
        started = time.perf_counter()
        try:
            session.run_with_iobinding(binding)
        except Exception as exc:
            if type(exc).__module__.startswith("onnxruntime"):
                raise ModelFileError(f"onnxruntime failed to run the model: {exc}") from exc
            raise
        self.ort_seconds += time.perf_counter() - started
        if session is self.session and self.steps_only and not self.guard:
            raise ModelFileError("a step the decode graph does not admit (its guard is false: "
                                 "not one new, kept token per row inside the position tables)",
                                 hint="run with --prompt-as-written (the file as written)")
        if not iface.shared:
            values = binding.get_outputs()
            for name, value in zip(self.outputs, values, strict=True):
                if name in self.presents:
                    self.cache[self.presents[name]] = value
        return logits[:, -1, :].astype(np.float32, copy=False), logits.shape[1]


def _output_dtype(session: Any, name: str) -> str:
    kind = next(o.type for o in session.get_outputs() if o.name == name)
    return {"tensor(float)": "float32", "tensor(float16)": "float16",
            "tensor(double)": "float64"}.get(kind, "float32")
