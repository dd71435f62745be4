"""Export the encoder's self-attention as onnxruntime's fused `com.microsoft.Attention` node.

The dynamo exporter decomposes nn.MultiheadAttention into about 50 nodes per layer (seven Transposes of the full
activations among them), and `onnxruntime.transformers.optimizer` does not fuse that pattern (docs/BENCHMARKS.md,
Export, "What was tried"). At export time only, each layer's `self_attn` is swapped for `FusedSelfAttention`: the
same parameters and the same maths in PyTorch (a custom op whose eager kernel is scaled_dot_product_attention),
which the exporter translates to one Attention node (QKV projection, key padding mask, optional causal mask, softmax,
weighted sum of values). Dynamic int8 quantisation turns it into QAttention. trainer/model/encoder.py is untouched, and
export validation compares the fused graph with the plain model, not with the swapped one.

Attention (com.microsoft, opset 1): input (B, T, d), weights (d, 3d), bias (3d), mask_index (B, T) int32 with
1 = attend; `unidirectional=1` adds the causal mask; masked scores get -10000 before the softmax (PyTorch uses the
dtype's minimum: both give an exact 0 probability after exp).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from onnx.defs import OpSchema
from onnxscript import opset18 as op
from onnxscript._internal.values import Op, Opset
from torch import Tensor, nn

DOMAIN = "com.microsoft"

# onnxscript needs a schema to build a node; the contrib op's is not in onnx.defs, so declare the inputs we use.
_ATTENTION_SCHEMA = OpSchema(
    "Attention",
    DOMAIN,
    1,
    inputs=[OpSchema.FormalParameter(name, t) for name, t in
            (("input", "T"), ("weights", "T"), ("bias", "T"), ("mask_index", "M"))],
    outputs=[OpSchema.FormalParameter("output", "T")],
    type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("M", ["tensor(int32)"], "")],
    attributes=[OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, "attention heads"),
                OpSchema.Attribute("unidirectional", OpSchema.AttrType.INT, "1: causal", required=False)],
)
_Attention = Op(Opset(DOMAIN, 1), "Attention", _ATTENTION_SCHEMA)


@torch.library.custom_op("transfer_sentiment::self_attention", mutates_args=())
def self_attention(x: Tensor, in_proj_weight: Tensor, in_proj_bias: Tensor, key_mask: Tensor, num_heads: int,
                   causal: bool) -> Tensor:
    """(B, T, d), (3d, d), (3d,), (B, T) int32 1 = real -> (B, T, d): heads concatenated, before out_proj."""
    B, T, d = x.shape
    q, k, v = F.linear(x, in_proj_weight, in_proj_bias).view(B, T, 3, num_heads, d // num_heads).permute(2, 0, 3, 1, 4)
    neg = torch.finfo(x.dtype).min
    bias = torch.zeros(B, 1, 1, T, dtype=x.dtype, device=x.device).masked_fill(key_mask.view(B, 1, 1, T) == 0, neg)
    if causal:
        upper = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        bias = bias + torch.zeros(T, T, dtype=x.dtype, device=x.device).masked_fill(upper, neg)  # (B, 1, T, T)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # (B, h, T, d/h)
    return out.transpose(1, 2).reshape(B, T, d)


@self_attention.register_fake
def _(x: Tensor, in_proj_weight: Tensor, in_proj_bias: Tensor, key_mask: Tensor, num_heads: int,
      causal: bool) -> Tensor:
    return torch.empty_like(x)


def self_attention_onnx(x, in_proj_weight, in_proj_bias, key_mask, num_heads: int, causal: bool):
    """The custom op as one Attention node; the weight transpose is folded into the initializer at export."""
    return _Attention(x, op.Transpose(in_proj_weight, perm=[1, 0]), in_proj_bias, key_mask,
                      num_heads=num_heads, unidirectional=int(causal))


# For torch.onnx.export(custom_translation_table=...).
TRANSLATION_TABLE = {torch.ops.transfer_sentiment.self_attention.default: self_attention_onnx}


class FusedSelfAttention(nn.MultiheadAttention):
    """nn.MultiheadAttention (batch_first, self-attention only) whose forward is the `self_attention` custom op.
    A subclass, so nn.TransformerEncoderLayer finds every attribute it inspects."""

    causal: bool

    @classmethod
    def from_module(cls, mha: nn.MultiheadAttention, causal: bool) -> FusedSelfAttention:
        if not (mha.batch_first and mha._qkv_same_embed_dim and mha.in_proj_bias is not None):
            raise ValueError("fused attention needs batch_first self-attention with a packed, biased in_proj")
        fused = cls(mha.embed_dim, mha.num_heads, dropout=mha.dropout, batch_first=True)
        fused.load_state_dict(mha.state_dict())
        fused.causal = causal
        return fused.eval()

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, None]:
        # The encoder passes an additive float padding mask (0 = real) and a causal mask iff the model is causal.
        assert query is key is value, "self-attention only"
        assert (attn_mask is not None) == self.causal, "attention mask does not match the model's causal flag"
        B, T, _ = query.shape
        if key_padding_mask is None:
            key_mask = torch.ones(B, T, dtype=torch.int32, device=query.device)
        elif key_padding_mask.dtype == torch.bool:
            key_mask = (~key_padding_mask).to(torch.int32)
        else:
            key_mask = (key_padding_mask == 0).to(torch.int32)
        out = torch.ops.transfer_sentiment.self_attention(query, self.in_proj_weight, self.in_proj_bias, key_mask,
                                                          self.num_heads, self.causal)
        return self.out_proj(out), None


def with_fused_attention(model: nn.Module) -> nn.Module:
    """A copy of a Classifier whose encoder layers use FusedSelfAttention (same weights); `model` is unchanged."""
    fused = copy.deepcopy(model)
    causal = bool(model.cfg.classifier_causal)
    for layer in fused.encoder.layers.layers:
        layer.self_attn = FusedSelfAttention.from_module(layer.self_attn, causal)
    return fused.eval()
