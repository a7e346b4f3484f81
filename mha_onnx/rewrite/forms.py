"""A chosen kernel form as data: what stage 2 made of a block, from which the label people
read is rendered and which verification reads (never the label itself).

A form is one kernel call (``kernel``), possibly behind a run-time ``guard`` (an ``If``)
whose other branch is another form (``otherwise``). ``switch_at`` holds the key lengths at
which a guard on the length first picks the other branch (verification runs past each), and
``cases`` the kinds of run only a branch takes (verification runs each kind), ``reach`` a
sliding window the kernel applies (verification runs with more keys than that). ``keys``:
the key length as an expression of input dims where it is not an input dim itself (a speech
encoder's frames, ``sequence_length // 10 - 1`` of its samples), so that verification runs
the input lengths at which the keys cross each switch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# Kinds of run that only some branch of a form takes.
NO_PAST = "no past"  # a KV-cache model's prompt
ONE_TOKEN = "one new token"  # a decode step
UNPADDED = "no key padded"  # a batch without padding
LEFT_PADDED = "left-padded rows"  # rows padded before their first kept key (a batched prompt)
SHARED = "shared cache buffer"  # a past that is a max-length buffer (lower/shared.py)
COUNTED = "positions counted up"  # a prompt whose position ids count up (rotary_fold.py)
CHUNK = "a chunk after a past, one row"  # a prompt run in chunks (serve --prefill-chunk)


@dataclass(frozen=True)
class Form:
    kernel: str
    guard: str = ""
    otherwise: Form | None = None
    switch_at: tuple[int, ...] = ()
    cases: frozenset[str] = field(default_factory=frozenset)
    reach: int = 0  # a sliding window: verification runs with more keys than this
    keys: str = ""  # the key length in input dims, where it is an expression of them
    positions: str = ""  # the input whose values a branch reads as position ids (COUNTED)

    @property
    def label(self) -> str:
        """e.g. ``If(T < 128): MHA key_padding_mask | Loop(Compress keys)``."""
        head = f"If({self.guard}): {self.kernel}" if self.guard else self.kernel
        return head if self.otherwise is None else f"{head} | {self.otherwise.label}"

    def chain(self) -> list[Form]:
        """This form and every form behind its guards, in order."""
        out, current = [], self
        while current is not None:
            out.append(current)
            current = current.otherwise
        return out

    def switches(self) -> set[int]:
        return {n for form in self.chain() for n in form.switch_at}

    def reaches(self) -> set[int]:
        return {form.reach for form in self.chain() if form.reach}

    def all_cases(self) -> set[str]:
        return {c for form in self.chain() for c in form.cases}

    def __str__(self) -> str:
        return self.label


def either(guard: str, kernel: str, otherwise: Form | str, *, switch_at: tuple[int, ...] = (),
           cases: tuple[str, ...] = (), reach: int = 0) -> Form:
    """``If(guard): kernel | otherwise``."""
    other = otherwise if isinstance(otherwise, Form) else Form(otherwise)
    return Form(kernel, guard, other, switch_at, frozenset(cases), reach)


def rotating_form(form: Form, positions: str, prompts: bool = True) -> Form:
    """``form`` whose first kernel rotates Q and K itself (rotary_fold.py) where ``positions``
    are inside its tables and, for a kernel that also runs prompts, count up (or the run adds
    one token): ``If(guard, positions ...): kernel, rotary inside | If(guard): kernel | ...``,
    the same kernel reading the exporter's rotation next; for prompts, between the two,
    the kernel reading Q and K rotated by RotaryEmbedding where the positions are inside the
    tables but not counted up."""
    check = "positions counted" if prompts else "positions in the tables"
    guard = f"{form.guard}, {check}" if form.guard else check
    otherwise = form
    if prompts:  # a prompt not counted up (left-padded rows): RotaryEmbedding, then the kernel
        inside = f"{form.guard}, positions in the tables" if form.guard else \
            "positions in the tables"
        otherwise = replace(form, kernel=f"RotaryEmbedding, {form.kernel}", guard=inside,
                            otherwise=form)
    return replace(form, kernel=f"{form.kernel}, rotary inside", guard=guard,
                   otherwise=otherwise, cases=form.cases | {COUNTED}, positions=positions)


def rotating_kernels(form: Form, positions: str, *, step: bool, prompt: bool) -> Form:
    """``form`` with the kernels rotary_fold.py folded marked (rotating_form): the one-token step's
    (``step``: the form's first) and those that run prompts (``prompt``: each form that runs
    without a past or a chunk after one, NO_PAST or CHUNK among its cases, else the first: a
    model without a cache)."""
    chain = form.chain()
    prompts = {i for i, f in enumerate(chain) if f.cases & {NO_PAST, CHUNK}} or {0} \
        if prompt else set()
    out = None
    for i in reversed(range(len(chain))):
        current = chain[i] if out is None else replace(chain[i], otherwise=out)
        if i in prompts:
            current = rotating_form(current, positions, prompts=True)
        elif i == 0 and step:
            current = rotating_form(current, positions, prompts=False)
        out = current
    return out
