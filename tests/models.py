"""Attention graphs exported from code this project did not write: torch.nn modules,
F.scaled_dot_product_attention, Transformer layers, Hugging Face models built from configs
with random weights (nothing is downloaded): the test-model library, used by the fusion tests
and by the benchmarks and checks in tools/.

Every builder returns an ``onnx.ModelProto`` exported with dynamic batch/sequence dims.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import warnings
from collections.abc import Callable

import onnx
import torch
import torch.nn.functional as F
from torch import nn

logging.getLogger("torch.onnx").setLevel(logging.ERROR)

D, H = 32, 4  # small but real: head dim 8 (a multiple of 8, as ORT's GQA needs)


def export(module: nn.Module, args: tuple, dynamic: dict, *, opset: int = 18,
           names: list[str] | None = None) -> onnx.ModelProto:
    """torch.onnx dynamo export with dynamic dims, quietly."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module.eval(), args, dynamo=True, dynamic_shapes=dynamic, opset_version=opset,
            input_names=names, verbose=False, optimize=True,
        )
    return program.model_proto


def batch_seq_dims():
    return torch.export.Dim("batch", min=1), torch.export.Dim("seq", min=1), torch.export.Dim("seq_kv", min=1)


class TorchMha(nn.Module):
    def __init__(self, batch_first: bool, mode: str) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(D, H, batch_first=batch_first)
        self.mode = mode

    def forward(self, query, key=None, value=None, key_padding_mask=None):
        if key is None:  # self-attention: the packed in-projection path
            key = value = query
        attn_mask = None
        n = query.shape[1] if self.mha.batch_first else query.shape[0]
        if self.mode == "causal":
            attn_mask = torch.ones(n, n, dtype=torch.bool, device=query.device).triu(1)
        elif self.mode == "causal_float":  # nn.Transformer.generate_square_subsequent_mask
            attn_mask = nn.Transformer.generate_square_subsequent_mask(n, device=query.device)
        return self.mha(query, key, value, key_padding_mask=key_padding_mask,
                        attn_mask=attn_mask, need_weights=False)[0]


def torch_mha(batch_first: bool = True, mode: str = "self") -> onnx.ModelProto:
    """nn.MultiheadAttention: mode self | cross | key_padding | causal | causal_float."""
    torch.manual_seed(0)
    batch, seq, seq_kv = batch_seq_dims()
    module = TorchMha(batch_first, mode)
    b_ax, s_ax = (0, 1) if batch_first else (1, 0)

    def x(n):
        shape = [2, n, D] if batch_first else [n, 2, D]
        return torch.randn(shape)

    if mode == "cross":
        args = (x(5), x(7), x(7))
        dyn = {"query": {b_ax: batch, s_ax: seq}, "key": {b_ax: batch, s_ax: seq_kv},
               "value": {b_ax: batch, s_ax: seq_kv}}
        return export(module, args, dyn)
    if mode == "key_padding":
        args = (x(5), None, None, torch.zeros(2, 5, dtype=torch.bool))
        dyn = {"query": {b_ax: batch, s_ax: seq}, "key": None, "value": None,
               "key_padding_mask": {0: batch, 1: seq}}
        return export(module, args, dyn)
    return export(module, (x(5),), {"query": {b_ax: batch, s_ax: seq}})


class _Sdpa(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def forward(self, q, k, v, mask=None):
        if self.mode == "causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.mode == "key_padding":  # [B, T] -> [B, 1, 1, T], True = attend
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sdpa(mode: str = "none", opset: int = 18) -> onnx.ModelProto:
    """F.scaled_dot_product_attention on [B, H, S, Dh]: none | bool | float | causal |
    key_padding (a [B, T] keep mask broadcast as [B, 1, 1, T])."""
    torch.manual_seed(0)
    batch, seq, seq_kv = batch_seq_dims()
    dh = D // H
    q, k, v = torch.randn(2, H, 5, dh), torch.randn(2, H, 7, dh), torch.randn(2, H, 7, dh)
    dyn = {"q": {0: batch, 2: seq}, "k": {0: batch, 2: seq_kv}, "v": {0: batch, 2: seq_kv}}
    if mode == "causal":
        k, v = torch.randn(2, H, 5, dh), torch.randn(2, H, 5, dh)
        dyn = {"q": {0: batch, 2: seq}, "k": {0: batch, 2: seq}, "v": {0: batch, 2: seq}}
        return export(_Sdpa(mode), (q, k, v), dyn, opset=opset)
    if mode == "none":
        return export(_Sdpa(mode), (q, k, v), dyn, opset=opset)
    if mode == "key_padding":
        mask = torch.ones(2, 7, dtype=torch.bool)
        return export(_Sdpa(mode), (q, k, v, mask), dict(dyn, mask={0: batch, 1: seq_kv}), opset=opset)
    mask = torch.ones(2, 1, 5, 7, dtype=torch.bool) if mode == "bool" else torch.randn(2, 1, 5, 7)
    return export(_Sdpa(mode), (q, k, v, mask), dict(dyn, mask={0: batch, 2: seq, 3: seq_kv}), opset=opset)


class _Scaled(nn.Module):
    """Hand-written attention with the scale spelled in different ways."""

    def __init__(self, scale: str) -> None:
        super().__init__()
        self.scale = scale
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, H, D // H).permute(2, 0, 3, 1, 4)
        dh = D // H
        if self.scale == "div":
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(dh)
        elif self.scale == "mul":
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(dh))
        elif self.scale == "split":
            f = dh ** -0.25
            scores = (q * f) @ (k * f).transpose(-2, -1)
        else:
            scores = q @ k.transpose(-2, -1)
        out = scores.softmax(dim=-1) @ v
        return self.out(out.transpose(1, 2).reshape(b, s, D))


def scaled(scale: str) -> onnx.ModelProto:
    """Self-attention with scale as div | mul | split (d^-1/4 on Q and K) | none."""
    torch.manual_seed(0)
    batch, seq, _ = batch_seq_dims()
    return export(_Scaled(scale), (torch.randn(2, 5, D),), {"x": {0: batch, 1: seq}})


class _Bmm(nn.Module):
    """Rank-3 attention on [B*H, S, Dh] (the bmm form of older exporters)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        split = lambda t: t.reshape(b, s, H, D // H).transpose(1, 2).reshape(b * H, s, D // H)  # noqa: E731
        q, k, v = split(q), split(k), split(v)
        attn = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / math.sqrt(D // H), dim=-1)
        return torch.bmm(attn, v).reshape(b, H, s, D // H).transpose(1, 2).reshape(b, s, D)


def bmm_attention() -> onnx.ModelProto:
    torch.manual_seed(0)
    batch, seq, _ = batch_seq_dims()
    return export(_Bmm(), (torch.randn(2, 5, D),), {"x": {0: batch, 1: seq}})


class _Encoder(nn.Module):
    def __init__(self, norm_first: bool) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(D, H, 2 * D, dropout=0.0, batch_first=True,
                                           norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, src, src_key_padding_mask):
        return self.encoder(src, src_key_padding_mask=src_key_padding_mask)


def encoder(norm_first: bool) -> onnx.ModelProto:
    """TransformerEncoder (2 layers) with a source key-padding mask."""
    torch.manual_seed(0)
    batch, seq, _ = batch_seq_dims()
    args = (torch.randn(2, 5, D), torch.zeros(2, 5, dtype=torch.bool))
    return export(_Encoder(norm_first), args,
                  {"src": {0: batch, 1: seq}, "src_key_padding_mask": {0: batch, 1: seq}})


class _Decoder(nn.Module):
    def __init__(self, norm_first: bool, float_mask: bool) -> None:
        super().__init__()
        layer = nn.TransformerDecoderLayer(D, H, 2 * D, dropout=0.0, batch_first=True,
                                           norm_first=norm_first)
        self.decoder = nn.TransformerDecoder(layer, 2)
        self.float_mask = float_mask

    def forward(self, tgt, memory, memory_key_padding_mask, tgt_key_padding_mask=None):
        n = tgt.shape[1]
        if self.float_mask:
            causal = nn.Transformer.generate_square_subsequent_mask(n, device=tgt.device)
        else:
            causal = torch.ones(n, n, dtype=torch.bool, device=tgt.device).triu(1)
        return self.decoder(tgt, memory, tgt_mask=causal, tgt_is_causal=True,
                            memory_key_padding_mask=memory_key_padding_mask,
                            tgt_key_padding_mask=tgt_key_padding_mask)


def decoder(norm_first: bool, float_mask: bool = False, tgt_padding: bool = False) -> onnx.ModelProto:
    """TransformerDecoder (2 layers): causal self-attention (bool or float tgt_mask, with a
    target key padding mask when ``tgt_padding``), cross-attention with padding."""
    torch.manual_seed(0)
    batch, seq, seq_kv = batch_seq_dims()
    args = (torch.randn(2, 5, D), torch.randn(2, 7, D), torch.zeros(2, 7, dtype=torch.bool))
    dyn = {"tgt": {0: batch, 1: seq}, "memory": {0: batch, 1: seq_kv},
           "memory_key_padding_mask": {0: batch, 1: seq_kv}}
    if tgt_padding:
        args += (torch.zeros(2, 5, dtype=torch.bool),)
        dyn["tgt_key_padding_mask"] = {0: batch, 1: seq}
    return export(_Decoder(norm_first, float_mask), args, dyn)


# -- causal masks as exporters spell them (and near misses that must not read as causal) -------

NEG_INF = float("-inf")


class _Spelled(nn.Module):
    """Self-attention whose mask is spelled ``spelling``; ``padding`` adds a [B, S] key
    padding mask input (True = padded)."""

    MAX = 64  # cached buffer length

    def __init__(self, spelling: str, padding: bool = False) -> None:
        super().__init__()
        self.spelling, self.padding = spelling, padding
        self.qkv = nn.Linear(D, 3 * D)
        self.register_buffer("tril", torch.tril(torch.ones(self.MAX, self.MAX, dtype=torch.bool)))

    def _mask(self, scores, s):  # noqa: C901 - one branch per spelling, on purpose
        ones = torch.ones(s, s, dtype=torch.bool, device=scores.device)
        i = torch.arange(s, device=scores.device)
        low = torch.finfo(scores.dtype).min
        sp = self.spelling
        if sp == "triu1_bool":  # masked where j > i (nn.MultiheadAttention's bool attn_mask)
            return scores.masked_fill(ones.triu(1), NEG_INF)
        if sp == "tril_keep_min":  # keep where j <= i, finfo.min elsewhere
            return torch.where(ones.tril(), scores, torch.full_like(scores, low))
        if sp == "triu_float_add":  # nn.Transformer.generate_square_subsequent_mask
            return scores + torch.full((s, s), NEG_INF, device=scores.device).triu(1)
        if sp == "triu_min_add":
            return scores + torch.full((s, s), low, device=scores.device).triu(1)
        if sp == "arange_ge":  # arange(S)[:, None] >= arange(T)[None, :]
            return scores.masked_fill(~(i[:, None] >= i[None, :]), NEG_INF)
        if sp == "buffer_slice":  # a cached lower-triangular buffer sliced to [:S, :T]
            return scores.masked_fill(~self.tril[:s, :s], NEG_INF)
        if sp == "buffer_slice_br":  # GPT-2's old [T - S:T, :T] (bottom-right) slice
            return scores.masked_fill(~self.tril[s - s:s, :s], low)
        if sp == "mask_before_scale":  # the mask added, the sum scaled afterwards
            return (scores * math.sqrt(D // H) + torch.full((s, s), NEG_INF).triu(1)) / math.sqrt(D // H)
        if sp == "window3":  # causal, each query keeps its last 3 keys (Mistral's overlay)
            return scores.masked_fill(~((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 3)), NEG_INF)
        # near misses: none of these is causal
        if sp == "inverted":  # masks the past: Where(tril, -inf, s)
            return torch.where(ones.tril(-1), torch.full_like(scores, NEG_INF), scores)
        if sp == "diagonal_plus_one":  # keeps j <= i + 1
            return scores.masked_fill(ones.triu(2), NEG_INF)
        if sp == "window_only":  # keeps j > i - 3, future included
            return scores.masked_fill(~(i[None, :] > i[:, None] - 3), NEG_INF)
        if sp == "causal_below_40":  # causal only for the first 40 queries: looks causal when short
            return scores.masked_fill(ones.triu(1) & (i[:, None] < 40), NEG_INF)
        raise ValueError(sp)

    def forward(self, x, key_padding_mask=None):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, H, D // H).permute(2, 0, 3, 1, 4)  # (B, H, S, Dh)
        scores = self._mask(q @ k.transpose(-2, -1) / math.sqrt(D // H), s)
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], NEG_INF)
        out = scores.softmax(dim=-1) @ v
        return out.transpose(1, 2).reshape(b, s, D)


def spelled(spelling: str, padding: bool = False) -> onnx.ModelProto:
    torch.manual_seed(0)
    batch, seq, _ = batch_seq_dims()
    x = torch.randn(2, 5, D)
    if padding:
        args = (x, torch.zeros(2, 5, dtype=torch.bool))
        return export(_Spelled(spelling, True), args,
                      {"x": {0: batch, 1: seq}, "key_padding_mask": {0: batch, 1: seq}})
    return export(_Spelled(spelling), (x,), {"x": {0: batch, 1: seq}})


class _HfMaskBuilder(nn.Module):
    """Attention with a mask from Hugging Face's ``sdpa_mask`` (causal + padding), built with
    broadcast indices or with ``vmap``."""

    def __init__(self, use_vmap: bool) -> None:
        super().__init__()
        self.use_vmap = use_vmap
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x, attention_mask):
        from transformers.masking_utils import causal_mask_function, sdpa_mask

        b, s, _ = x.shape
        keep = sdpa_mask(b, s, s, mask_function=causal_mask_function,
                         attention_mask=attention_mask.bool(), allow_is_causal_skip=False,
                         use_vmap=self.use_vmap)  # (B, 1, S, S), True = attend
        q, k, v = self.qkv(x).view(b, s, 3, H, D // H).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(D // H)).masked_fill(~keep, NEG_INF)
        return (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, s, D)


def hf_mask_builder(use_vmap: bool) -> onnx.ModelProto:
    torch.manual_seed(0)
    batch, seq, _ = batch_seq_dims()
    args = (torch.randn(2, 5, D), torch.ones(2, 5, dtype=torch.int64))
    return export(_HfMaskBuilder(use_vmap), args,
                  {"x": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}})


CAUSAL_SPELLINGS = ("triu1_bool", "tril_keep_min", "triu_float_add", "triu_min_add", "arange_ge",
                    "buffer_slice", "buffer_slice_br", "mask_before_scale", "window3")
NOT_CAUSAL = ("inverted", "diagonal_plus_one", "window_only", "causal_below_40")


class _CachedGpt2Style(nn.Module):
    """A decoder layer with a KV cache the way GPT-2's legacy code wrote it: past keys and
    values concatenated with the new ones, the causal mask sliced from a cached
    lower-triangular buffer at [T - S:T, :T] (aligned to the end of the keys)."""

    MAX = 256

    def __init__(self, kv_heads: int = H) -> None:
        super().__init__()
        self.kv_heads = kv_heads
        self.qkv = nn.Linear(D, D + 2 * kv_heads * (D // H))
        self.proj = nn.Linear(D, D)
        self.register_buffer("bias", torch.tril(torch.ones(self.MAX, self.MAX, dtype=torch.bool))
                             .view(1, 1, self.MAX, self.MAX))

    def forward(self, x, past_key, past_value):
        b, s, _ = x.shape
        g = self.kv_heads
        q, k, v = self.qkv(x).split([D, g * (D // H), g * (D // H)], dim=2)
        heads = lambda t: t.view(b, s, -1, D // H).transpose(1, 2)  # noqa: E731 - (B, H, S, Dh)
        q, k, v = heads(q), heads(k), heads(v)
        k = torch.cat([past_key, k], dim=-2)
        v = torch.cat([past_value, v], dim=-2)
        present = (k, v)
        if g != H:  # Llama's repeat_kv: each K/V head serves H // g query heads
            wide = lambda t: t[:, :, None].expand(b, g, H // g, *t.shape[2:]).reshape(  # noqa: E731
                b, H, *t.shape[2:])
            k, v = wide(k), wide(v)
        t = k.shape[-2]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D // H)
        keep = self.bias[:, :, t - s:t, :t]
        scores = torch.where(keep, scores, torch.tensor(torch.finfo(scores.dtype).min))
        out = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, s, D)
        return self.proj(out), *present


def cached_gpt2_style(kv_heads: int = H) -> onnx.ModelProto:
    torch.manual_seed(0)
    batch, seq, _ = batch_seq_dims()
    past = torch.export.Dim("past", min=0, max=_CachedGpt2Style.MAX - 64)
    seq = torch.export.Dim("seq", min=1, max=64)
    args = (torch.randn(2, 5, D), torch.randn(2, kv_heads, 7, D // H),
            torch.randn(2, kv_heads, 7, D // H))
    return export(_CachedGpt2Style(kv_heads), args, {"x": {0: batch, 1: seq},
                                              "past_key": {0: batch, 2: past},
                                              "past_value": {0: batch, 2: past}},
                  names=["x", "past_key", "past_value"])


class RelativeBiasCausal(nn.Module):
    """Causal self-attention plus a learned relative position bias (T5's decoder, with
    clipped distances instead of buckets): a size-only float bias next to the causal mask."""

    def __init__(self, d_model: int = D, heads: int = H, distances: int = 16) -> None:
        super().__init__()
        self.d_model, self.heads, self.distances = d_model, heads, distances
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.rel = nn.Embedding(distances, heads)

    def forward(self, x):
        b, s, _ = x.shape
        d, h, far = self.d_model, self.heads, self.distances - 1
        q, k, v = self.qkv(x).view(b, s, 3, h, d // h).permute(2, 0, 3, 1, 4)
        pos = torch.arange(s, device=x.device)
        bias = self.rel((pos[None, :] - pos[:, None]).clamp(-far, 0).neg()).permute(2, 0, 1)[None]
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        scores = ((q @ k.transpose(-2, -1)) / math.sqrt(d // h) + bias).masked_fill(future, NEG_INF)
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)


def relative_bias_causal() -> onnx.ModelProto:
    torch.manual_seed(0)
    batch, seq, _ = batch_seq_dims()
    return export(RelativeBiasCausal(), (torch.randn(2, 5, D),), {"x": {0: batch, 1: seq}})


# -- Hugging Face transformers, built from configs with random weights ------------------------

class HfWrap(nn.Module):
    def __init__(self, model: nn.Module, keys: list[str], output: str) -> None:
        super().__init__()
        self.model, self.keys, self.output = model, keys, output

    def forward(self, *args):
        out = self.model(**dict(zip(self.keys, args, strict=True)), use_cache=False) if "use_cache" in self.model.forward.__code__.co_varnames else self.model(**dict(zip(self.keys, args, strict=True)))
        return getattr(out, self.output)


def hf(name: str, attn: str = "sdpa") -> onnx.ModelProto:
    """bert | gpt2 | bart | t5 | vit, tiny configs, random weights, attn_implementation ``attn``."""
    import transformers as tf

    torch.manual_seed(0)
    batch, seq, seq_kv = batch_seq_dims()
    ids = torch.randint(0, 99, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.int64)
    small = dict(attn_implementation=attn)
    if name == "bert":
        cfg = tf.BertConfig(vocab_size=99, hidden_size=D, num_hidden_layers=2, num_attention_heads=H,
                            intermediate_size=2 * D, max_position_embeddings=128, **small)
        model = HfWrap(tf.BertModel(cfg), ["input_ids", "attention_mask"], "last_hidden_state")
        dyn = {"args": ({0: batch, 1: seq}, {0: batch, 1: seq})}
        return export(model, (ids, mask), dyn, names=["input_ids", "attention_mask"])
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=99, n_embd=D, n_layer=2, n_head=H, n_positions=128, **small)
        model = HfWrap(tf.GPT2Model(cfg), ["input_ids", "attention_mask"], "last_hidden_state")
        dyn = {"args": ({0: batch, 1: seq}, {0: batch, 1: seq})}
        return export(model, (ids, mask), dyn, names=["input_ids", "attention_mask"])
    if name == "bart":
        cfg = tf.BartConfig(vocab_size=99, d_model=D, encoder_layers=1, decoder_layers=1,
                            encoder_attention_heads=H, decoder_attention_heads=H,
                            encoder_ffn_dim=2 * D, decoder_ffn_dim=2 * D,
                            max_position_embeddings=128, **small)
        dec = torch.randint(0, 99, (2, 5))
        model = HfWrap(tf.BartModel(cfg), ["input_ids", "attention_mask", "decoder_input_ids"],
                        "last_hidden_state")
        dyn = {"args": ({0: batch, 1: seq_kv}, {0: batch, 1: seq_kv}, {0: batch, 1: seq})}
        return export(model, (ids, mask, dec), dyn,
                      names=["input_ids", "attention_mask", "decoder_input_ids"])
    if name == "t5":
        cfg = tf.T5Config(vocab_size=99, d_model=D, d_kv=D // H, d_ff=2 * D, num_layers=1,
                          num_decoder_layers=1, num_heads=H, **small)
        dec = torch.randint(0, 99, (2, 5))
        model = HfWrap(tf.T5Model(cfg), ["input_ids", "attention_mask", "decoder_input_ids"],
                        "last_hidden_state")
        dyn = {"args": ({0: batch, 1: seq_kv}, {0: batch, 1: seq_kv}, {0: batch, 1: seq})}
        return export(model, (ids, mask, dec), dyn,
                      names=["input_ids", "attention_mask", "decoder_input_ids"])
    if name == "vit":
        cfg = tf.ViTConfig(hidden_size=D, num_hidden_layers=2, num_attention_heads=H,
                           intermediate_size=2 * D, image_size=32, patch_size=8, **small)
        model = HfWrap(tf.ViTModel(cfg), ["pixel_values"], "last_hidden_state")
        pixels = torch.randn(2, 3, 32, 32)
        return export(model, (pixels,), {"args": ({0: batch},)}, names=["pixel_values"])
    raise ValueError(name)


# family -> (config class, model class, config fields beyond the common ones)
DECODERS: dict[str, tuple[str, str, dict]] = {
    "gpt2": ("GPT2Config", "GPT2Model", {}),
    "llama": ("LlamaConfig", "LlamaModel", {"num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", "Qwen2Model", {"num_key_value_heads": 2}),
    "mistral": ("MistralConfig", "MistralModel", {"num_key_value_heads": 2, "sliding_window": 4}),
    "gemma2": ("Gemma2Config", "Gemma2Model", {"num_key_value_heads": 2, "head_dim": 8,
               "sliding_window": 4, "attn_logit_softcapping": 50.0}),
    "qwen3": ("Qwen3Config", "Qwen3Model", {"num_key_value_heads": 2, "head_dim": 8}),
    "phi3": ("Phi3Config", "Phi3Model", {"num_key_value_heads": 2, "pad_token_id": 0}),
    "falcon": ("FalconConfig", "FalconModel", {"new_decoder_architecture": False,
               "multi_query": True}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXModel", {}),
    "opt": ("OPTConfig", "OPTModel", {"ffn_dim": 2 * D, "word_embed_proj_dim": D}),
    "starcoder2": ("Starcoder2Config", "Starcoder2Model", {"num_key_value_heads": 1}),
    "gptj": ("GPTJConfig", "GPTJModel", {"rotary_dim": 4}),
    # ALiBi folded into the scores with baddbmm on [B*H, S, T], softmax on [B, H, S, T]
    "bloom": ("BloomConfig", "BloomModel", {}),
    # the mask added on a [B, H, S, T] view of bmm's scores, clamped at the lowest float
    # (max(s + mask, finfo.min)), merged back for the Softmax, split and merged after it
    "xglm": ("XGLMConfig", "XGLMModel", {"ffn_dim": 2 * D, "num_layers": 1,
             "attention_heads": H, "d_model": D}),
    # ALiBi as a [H, 1, max_seq_len] table sliced to the keys; a float mask cast to bool
    "mpt": ("MptConfig", "MptModel", {"d_model": D, "n_layers": 1, "n_heads": H,
                                      "max_seq_len": 128}),
    # differential attention: one Softmax applied to two halves of V, O1 - lambda * O2
    "diffllama": ("DiffLlamaConfig", "DiffLlamaModel", {"num_key_value_heads": 2}),
}


def hf_decoder(family: str, attn: str = "eager", opset: int = 18, dtype: str = "float32", *,
               heads: int = H, head_dim: int | None = None, kv_heads: int | None = None,
               vocab: int = 99, max_positions: int = 128, **config) -> onnx.ModelProto:
    """A one-layer Hugging Face decoder of ``family`` (DECODERS) from a tiny config (random
    weights), fed ``input_ids`` and ``attention_mask`` [batch, seq]. Knobs: ``heads``,
    ``head_dim`` (hidden = heads x head_dim; default hidden 32), ``kv_heads``, ``vocab``,
    ``max_positions``; other config fields as keywords (they override the family's)."""
    import transformers as tf

    config_name, model_name, extra = DECODERS[family]
    hidden = heads * head_dim if head_dim else D
    knobs = {"head_dim": head_dim} if head_dim else {}
    if kv_heads is not None:
        knobs["num_key_value_heads"] = kv_heads
    common = {"vocab_size": vocab, "hidden_size": hidden, "n_embd": hidden,
              "num_hidden_layers": 1, "n_layer": 1, "num_attention_heads": heads,
              "n_head": heads, "intermediate_size": 2 * D,
              "max_position_embeddings": max_positions, "n_positions": max_positions,
              "attn_implementation": attn, "bos_token_id": 1, "eos_token_id": 2}
    made = getattr(tf, config_name)(**{**common, **extra, **knobs, **config})
    torch.manual_seed(0)
    model = getattr(tf, model_name)(made).eval()
    if dtype == "float16":
        model = model.half()
    batch, seq, _ = batch_seq_dims()
    ids, mask = torch.randint(0, vocab, (2, 6)), torch.ones(2, 6, dtype=torch.int64)
    wrapped = HfWrap(model, ["input_ids", "attention_mask"], "last_hidden_state")
    return export(wrapped, (ids, mask), {"args": ({0: batch, 1: seq}, {0: batch, 1: seq})},
                  opset=opset, names=["input_ids", "attention_mask"])


class CachedWrap(nn.Module):
    """A Hugging Face decoder fed one layer's legacy cache tensors, returning its presents."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, past_key, past_value):
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=self.model.config)
        cache.update(past_key, past_value, 0)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         past_key_values=cache, use_cache=True)
        layer = out.past_key_values.layers[0]
        return out.last_hidden_state, layer.keys, layer.values


def hf_cached_decoder(family: str, attn: str = "eager", opset: int = 18, *, hidden: int = D,
                      heads: int = H, kv_heads: int | None = None,
                      max_positions: int = 128, fields: dict | None = None
                      ) -> onnx.ModelProto:
    """A one-layer Hugging Face decoder with a KV cache, as Optimum-style exports have it:
    ``input_ids`` [batch, seq], ``attention_mask`` [batch, past + seq], ``past_key`` and
    ``past_value`` [batch, kv_heads, past, head_dim]; outputs the hidden state and the
    presents (DynamicCache's concatenation). Positions and the causal mask come from the
    cache's length inside the graph. Tiny by default; ``hidden``/``heads``/``kv_heads`` and
    config ``fields`` (over the family's own) for benchmarks."""
    import transformers as tf

    config_name, model_name, extra = DECODERS[family]
    extra = {**extra, **(fields or {})}
    if kv_heads is not None:
        extra["num_key_value_heads"] = kv_heads
    common = {"vocab_size": 99, "hidden_size": hidden, "num_hidden_layers": 1,
              "num_attention_heads": heads, "intermediate_size": 2 * hidden,
              "max_position_embeddings": max_positions, "attn_implementation": attn}
    config = getattr(tf, config_name)(**{**common, **extra})
    torch.manual_seed(0)
    model = getattr(tf, model_name)(config).eval()
    kv, head = extra.get("num_key_value_heads", heads), extra.get("head_dim", hidden // heads)
    ids, mask = torch.randint(0, 99, (2, 3)), torch.ones(2, 8, dtype=torch.int64)
    past_key, past_value = torch.randn(2, kv, 5, head), torch.randn(2, kv, 5, head)
    batch, seq, _ = batch_seq_dims()
    past, total = torch.export.Dim("past", min=1), torch.export.Dim("total", min=2)
    model_proto = export(CachedWrap(model), (ids, mask, past_key, past_value),
                         ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 2: past},
                          {0: batch, 2: past}), opset=opset,
                         names=["input_ids", "attention_mask", "past_key", "past_value"])
    for value in list(model_proto.graph.input) + list(model_proto.graph.output):
        for dim in value.type.tensor_type.shape.dim:  # torch.export cannot say total = past + seq
            if dim.dim_param == "total":
                dim.dim_param = "past + seq"
    return model_proto


ZOO: dict[str, Callable[[], onnx.ModelProto]] = {
    "torch_mha_self_bf": lambda: torch_mha(True, "self"),
    "torch_mha_self_sf": lambda: torch_mha(False, "self"),
    "torch_mha_cross_bf": lambda: torch_mha(True, "cross"),
    "torch_mha_cross_sf": lambda: torch_mha(False, "cross"),
    "torch_mha_key_padding": lambda: torch_mha(True, "key_padding"),
    "torch_mha_causal": lambda: torch_mha(True, "causal"),
    "torch_mha_causal_float": lambda: torch_mha(True, "causal_float"),
    "sdpa18_none": lambda: sdpa("none", 18),
    "sdpa18_bool": lambda: sdpa("bool", 18),
    "sdpa18_float": lambda: sdpa("float", 18),
    "sdpa18_causal": lambda: sdpa("causal", 18),
    "sdpa18_key_padding": lambda: sdpa("key_padding", 18),
    "sdpa23_none": lambda: sdpa("none", 23),
    "sdpa23_bool": lambda: sdpa("bool", 23),
    "sdpa23_float": lambda: sdpa("float", 23),
    "sdpa23_causal": lambda: sdpa("causal", 23),
    "sdpa23_key_padding": lambda: sdpa("key_padding", 23),
    "scale_div": lambda: scaled("div"),
    "scale_mul": lambda: scaled("mul"),
    "scale_split": lambda: scaled("split"),
    "scale_none": lambda: scaled("none"),
    "bmm_rank3": bmm_attention,
    "encoder_post_norm": lambda: encoder(False),
    "encoder_pre_norm": lambda: encoder(True),
    "decoder_post_norm": lambda: decoder(False),
    "decoder_pre_norm": lambda: decoder(True),
    "decoder_float_mask_tgt_padding": lambda: decoder(True, float_mask=True, tgt_padding=True),
    "hf_bert": lambda: hf("bert"),
    "hf_bert_eager": lambda: hf("bert", "eager"),
    "hf_gpt2": lambda: hf("gpt2"),
    "hf_gpt2_eager": lambda: hf("gpt2", "eager"),
    "hf_bart": lambda: hf("bart"),
    "hf_t5": lambda: hf("t5", "eager"),
    "hf_vit": lambda: hf("vit"),
    **{f"spelled_{name}": (lambda n=name: spelled(n)) for name in CAUSAL_SPELLINGS + NOT_CAUSAL},
    "spelled_triu1_bool_padded": lambda: spelled("triu1_bool", padding=True),
    "hf_mask_builder": lambda: hf_mask_builder(False),
    "hf_mask_builder_vmap": lambda: hf_mask_builder(True),
    "hf_bloom": lambda: hf_decoder("bloom"),
    "cached_gpt2_style": cached_gpt2_style,
    "cached_grouped": lambda: cached_gpt2_style(kv_heads=H // 2),
    "hf_cached_llama": lambda: hf_cached_decoder("llama"),
    # its caches reach the attention merged to [B*H, T, D] for a bmm (split back by fuse)
    "hf_cached_xglm": lambda: hf_cached_decoder("xglm", max_positions=256),
    "relative_bias_causal": relative_bias_causal,
}
