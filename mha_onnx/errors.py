"""The one error hierarchy of mha-onnx.

Every failure a user can cause (a missing file, a bad option, weights that do not fit) raises a
subclass of :class:`MhaOnnxError`. The CLI catches that class once, prints one line and a hint,
and exits non-zero; anything else is a bug and stays loud.
"""

from __future__ import annotations

# Exit codes shared by every command (documented in the README).
EXIT_OK = 0
EXIT_MISMATCH = 1  # the run worked and found outputs that differ beyond tolerance
EXIT_USAGE = 2  # bad input: files, options, configs, weights
EXIT_PROVIDER = 3  # a requested execution provider could not run
EXIT_INTERNAL = 4  # a bug of mha-onnx (not the user's input): please report it


class MhaOnnxError(Exception):
    """Base class of every error a user can cause; carries an optional hint."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class ConfigError(MhaOnnxError):
    """An impossible model config, an unknown preset or a malformed option value."""


class WeightsError(MhaOnnxError):
    """A checkpoint that cannot be read safely or does not fit the config."""


class ModelFileError(MhaOnnxError):
    """An ONNX file that is missing, unreadable, corrupt, unsupported or unsafe."""


class OutputExistsError(MhaOnnxError):
    """An output path that exists and would be replaced without --force."""


class ExportError(MhaOnnxError):
    """torch.onnx failed, or the exported graph failed a post-export check."""


class FusionError(MhaOnnxError):
    """A model made failed verification, outputs differing beyond tolerance (exit 1): the
    fused graph against the original, or an export against the PyTorch model."""

    exit_code = EXIT_MISMATCH


class FuseBug(FusionError):
    """A graph fuse wrote that ORT refuses to load or run, or that the model's opset cannot
    spell: mha-onnx's bug, not the user's input (exit 4, as any internal error)."""

    exit_code = EXIT_INTERNAL


class VerifyError(MhaOnnxError):
    """The original model cannot be run to verify the fused one against (exit 2)."""


class InputSpecError(MhaOnnxError):
    """Requested shapes or dtypes that the model's inputs cannot take."""


class ResourceError(MhaOnnxError):
    """A requested shape whose working set would not fit in memory."""


class ProviderError(MhaOnnxError):
    """A requested execution provider is unknown or cannot run here."""

    exit_code = EXIT_PROVIDER


class BlocksLeft(MhaOnnxError):
    """``fuse --strict``: some attention blocks could not be fused (exit 1, nothing written)."""

    exit_code = EXIT_MISMATCH


class RuntimeCrash(ProviderError):
    """ONNX Runtime died by a signal on this model (in a child process, so we did not)."""
