"""A Swin-T stage (two blocks: windows, then shifted windows) written as torchvision's and timm's
window attention compute it, exported with both of torch.onnx's exporters, for `fuse` and
`profile` (docs/families.md, "Shifted windows"). Random weights; nothing downloaded.

    python tools/swin_windows.py --out /tmp/swin [--image 56 --window 7 --dim 96 --heads 3]

writes ``{torchvision,timm}_{dynamo,torchscript}.onnx``, input ``x`` [batch, H, W, C].
"""

from __future__ import annotations

import argparse
import contextlib
import io
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def window_mask(size: int, window: int, shift: int) -> torch.Tensor:
    """[windows, N, N]: 0 between patches of one region of the shifted image, -100 across."""
    regions = torch.zeros(size, size)
    cuts = ((0, -window), (-window, -shift), (-shift, None))
    label = 0
    for rows in cuts:
        for cols in cuts:
            regions[rows[0]:rows[1], cols[0]:cols[1]] = label
            label += 1
    per_window = regions.view(size // window, window, size // window, window)
    per_window = per_window.permute(0, 2, 1, 3).reshape(-1, window * window)
    differs = per_window.unsqueeze(1) - per_window.unsqueeze(2)
    return differs.masked_fill(differs != 0, -100.0).masked_fill(differs == 0, 0.0)


class Block(nn.Module):
    """One Swin block's attention (the norms and MLP left out: they do not change what fuse
    sees). ``style``: torchvision scales Q and views the scores as ``[B // nW, nW, ...]``;
    timm scales Q·K^T and views them as ``[-1, nW, ...]``."""

    def __init__(self, dim: int, heads: int, window: int, shift: int, style: str) -> None:
        super().__init__()
        self.dim, self.heads, self.window, self.shift, self.style = dim, heads, window, shift, style
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        n = window * window
        self.position_bias = nn.Parameter(torch.randn(1, heads, n, n) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, size, _, dim = x.shape
        w, n, heads = self.window, self.window * self.window, self.heads
        y = torch.roll(x, (-self.shift, -self.shift), (1, 2)) if self.shift else x
        y = y.view(batch, size // w, w, size // w, w, dim).permute(0, 1, 3, 2, 4, 5)
        y = y.reshape(-1, n, dim)
        q, k, v = self.qkv(y).reshape(y.size(0), n, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
        if self.style == "torchvision":
            scores = (q * (dim // heads) ** -0.5) @ k.transpose(-2, -1)
        else:
            scores = (q @ k.transpose(-2, -1)) * (dim // heads) ** -0.5
        scores = scores + self.position_bias
        if self.shift:
            mask = window_mask(size, w, self.shift).to(x.dtype)
            windows = mask.shape[0]
            first = y.size(0) // windows if self.style == "torchvision" else -1
            scores = scores.view(first, windows, heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
            scores = scores.view(-1, heads, n, n)
        out = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(y.size(0), n, dim)
        out = self.proj(out).view(batch, size // w, size // w, w, w, dim)
        out = out.permute(0, 1, 3, 2, 4, 5).reshape(batch, size, size, dim)
        return x + (torch.roll(out, (self.shift, self.shift), (1, 2)) if self.shift else out)


def export(style: str, exporter: str, args: argparse.Namespace, path: Path) -> None:
    torch.manual_seed(0)
    stage = nn.Sequential(Block(args.dim, args.heads, args.window, 0, style),
                          Block(args.dim, args.heads, args.window, args.window // 2, style))
    x = torch.randn(2, args.image, args.image, args.dim)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            torch.onnx.export(stage.eval(), (x,), path, input_names=["x"], dynamo=True,
                              dynamic_shapes={"input": {0: torch.export.Dim("batch")}})
        else:
            torch.onnx.export(stage.eval(), (x,), path, input_names=["x"], dynamo=False,
                              dynamic_axes={"x": {0: "batch"}}, opset_version=17)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--image", type=int, default=56, help="patches per side")
    parser.add_argument("--window", type=int, default=7)
    parser.add_argument("--dim", type=int, default=96)
    parser.add_argument("--heads", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for style in ("torchvision", "timm"):
        for exporter in ("dynamo", "torchscript"):
            path = args.out / f"{style}_{exporter}.onnx"
            export(style, exporter, args, path)
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
