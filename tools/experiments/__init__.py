"""One-off measurements behind a design decision (each with its own timing loop), kept so the
figures in docs/fusion-forms.md can be made again: ``python -m tools.experiments.NAME``."""
