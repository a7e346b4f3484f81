"""Weight import: safetensors files and torch state_dicts, of this reference or of
torch.nn.MultiheadAttention, checked key by key against the config.

Checkpoints never execute code: torch files load with ``weights_only=True``.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from mha_onnx.config import MhaConfig
from mha_onnx.errors import WeightsError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PARAM_NAMES = ("w_q", "w_k", "w_v", "w_o")


def expected_shapes(config: MhaConfig) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape, in this package's naming."""
    d = config.d_model
    shapes = {
        "w_q.weight": (config.qk_dim, d),
        "w_k.weight": (config.qk_dim, d),
        "w_v.weight": (config.v_dim, d),
        "w_o.weight": (d, config.v_dim),
    }
    if config.bias:
        shapes.update(
            {
                "w_q.bias": (config.qk_dim,),
                "w_k.bias": (config.qk_dim,),
                "w_v.bias": (config.v_dim,),
                "w_o.bias": (d,),
            }
        )
    return shapes


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors from a .safetensors file or a torch checkpoint (weights_only=True)."""
    import torch

    path = Path(path)
    if not path.exists():
        raise WeightsError(f"weights file not found: {path}")
    if not path.is_file():
        raise WeightsError(f"weights path is not a file: {path}")
    if path.stat().st_size == 0:
        raise WeightsError(f"weights file is empty: {path}")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return dict(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise WeightsError(f"cannot read safetensors file {path}: {exc}") from exc
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise WeightsError(
            f"refused to load {path}: unpickling it would run code ({_culprit(exc)})",
            hint="save plain tensors (model.state_dict()) or convert to .safetensors",
        ) from exc
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as exc:
        raise WeightsError(
            f"cannot read {path} as a torch checkpoint: {_first_line(exc)}",
            hint="pass a .safetensors file or a torch.save()d state_dict",
        ) from exc
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise WeightsError(f"{path} does not hold a state_dict of tensors")
    return dict(loaded)


def _culprit(exc: BaseException) -> str:
    """What torch's weights_only unpickler refused (e.g. ``Unsupported global: posix.system``)."""
    for line in str(exc).splitlines():
        line = line.strip()
        if line.startswith(("Unsupported global", "Unsupported operand", "Unsupported class")):
            return line.split(". ")[0].rstrip(".")
    return "not plain tensors"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _strip_common_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop a shared module prefix such as ``self_attn.`` from every key."""
    anchors = ("w_q.weight", "in_proj_weight", "q_proj_weight")
    for key in state:
        for anchor in anchors:
            if key.endswith("." + anchor):
                prefix = key[: -len(anchor)]
                if all(k.startswith(prefix) for k in state):
                    return {k[len(prefix) :]: v for k, v in state.items()}
    return state


def to_reference_state(
    state: dict[str, torch.Tensor], config: MhaConfig
) -> dict[str, torch.Tensor]:
    """Map a checkpoint of this reference or of nn.MultiheadAttention onto this reference's
    parameter names, checking every key and shape against ``config``."""
    state = _strip_common_prefix(state)
    if "in_proj_weight" in state or "q_proj_weight" in state or "out_proj.weight" in state:
        state = _from_torch_mha(state, config)
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise WeightsError(
            f"weights lack key {missing[0]!r} (expected shape {list(expected[missing[0]])})"
            + (f"; also missing: {', '.join(missing[1:])}" if len(missing) > 1 else ""),
            hint=f"keys found: {', '.join(sorted(state)) or 'none'}",
        )
    if unexpected:
        raise WeightsError(
            f"weights have unexpected key {unexpected[0]!r} "
            f"(shape {list(state[unexpected[0]].shape)})",
            hint="bias keys need bias=true in the config; other keys are not part of the layer",
        )
    out = {}
    for key, shape in expected.items():
        tensor = state[key]
        if tuple(tensor.shape) != shape:
            raise WeightsError(
                f"weight {key!r} has shape {list(tensor.shape)}, the config needs {list(shape)}",
                hint=f"config: d_model={config.d_model}, num_heads={config.num_heads}, "
                f"d_k={config.d_k}, d_v={config.d_v}",
            )
        if not tensor.is_floating_point():
            raise WeightsError(f"weight {key!r} has dtype {tensor.dtype}, expected a float type")
        out[key] = tensor.detach().to("cpu").float()
    return out


def _from_torch_mha(state: dict[str, torch.Tensor], config: MhaConfig) -> dict[str, torch.Tensor]:
    for key in ("bias_k", "bias_v"):
        if key in state:
            raise WeightsError(
                f"nn.MultiheadAttention key {key!r} (add_bias_kv=True) has no counterpart here"
            )
    out: dict[str, torch.Tensor] = {}
    if "in_proj_weight" in state:
        packed = state["in_proj_weight"]
        want = (2 * config.qk_dim + config.v_dim, config.d_model)
        if tuple(packed.shape) != want:
            raise WeightsError(
                f"weight 'in_proj_weight' has shape {list(packed.shape)}, the config needs "
                f"{list(want)}"
            )
        q, k, v = packed.split([config.qk_dim, config.qk_dim, config.v_dim])
        out.update({"w_q.weight": q, "w_k.weight": k, "w_v.weight": v})
    else:
        for ours, theirs in (("w_q", "q"), ("w_k", "k"), ("w_v", "v")):
            if f"{theirs}_proj_weight" in state:
                out[f"{ours}.weight"] = state[f"{theirs}_proj_weight"]
    if "in_proj_bias" in state:
        packed = state["in_proj_bias"]
        want_len = 2 * config.qk_dim + config.v_dim
        if tuple(packed.shape) != (want_len,):
            raise WeightsError(
                f"weight 'in_proj_bias' has shape {list(packed.shape)}, the config needs "
                f"[{want_len}]"
            )
        q, k, v = packed.split([config.qk_dim, config.qk_dim, config.v_dim])
        out.update({"w_q.bias": q, "w_k.bias": k, "w_v.bias": v})
    for part in ("weight", "bias"):
        if f"out_proj.{part}" in state:
            out[f"w_o.{part}"] = state[f"out_proj.{part}"]
    known = {"in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight",
             "out_proj.weight", "out_proj.bias"}
    for key in set(state) - known:
        out[key] = state[key]  # left for the unexpected-key check to name
    return out


def load_weights(path: str | Path, config: MhaConfig) -> dict[str, torch.Tensor]:
    """Read ``path`` and return it in this reference's naming, checked against ``config``."""
    state = to_reference_state(read_checkpoint(path), config)
    log.info("loaded %d tensors from %s", len(state), path)
    return state


def checksum(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the parameters (name, shape and float32 bytes) in name order."""
    digest = hashlib.sha256()
    for name in sorted(state):
        array = state[name].detach().to("cpu").float().contiguous().numpy()
        digest.update(name.encode())
        digest.update(repr(tuple(array.shape)).encode())
        digest.update(array.tobytes())
    return digest.hexdigest()
