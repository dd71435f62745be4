"""The lab's Transformer encoder with a language-model head and a classification head. Plain PyTorch.

Shapes: B batch, T sequence, d = d_model, V vocabulary, C classes. Tensors are batch-first.
`padding_mask` is (B, T) bool, True at <pad> positions (PyTorch's key_padding_mask convention), or None when no
row is padded (packed pretraining windows). Sequences are right-padded: real tokens first, so the last real token of
row b sits at `lengths[b] - 1`; causal attention then needs no padding mask at all (Encoder.forward says why).

Both heads hold the encoder under the same name (`encoder.*`), so a classifier loads a pretrained encoder by key
(like HF `BertForSequenceClassification`); only `head.*` differs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from trainer.config.schema import ModelConfig


def sinusoidal_table(max_positions: int, d_model: int) -> torch.Tensor:
    """(max_positions, d): sin on even dims, cos on odd, frequencies 1 / 10000^(2i/d) (the lab's table)."""
    position = torch.arange(max_positions, dtype=torch.float32).unsqueeze(1)  # (P, 1)
    div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(max_positions, d_model)
    table[:, 0::2] = torch.sin(position * div_term)
    table[:, 1::2] = torch.cos(position * div_term[: d_model // 2])  # odd d: one fewer cos column
    return table


class Encoder(nn.Module):
    """Scaled token embedding + fixed positions + nn.TransformerEncoder (no final norm, as in the lab)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        # Not a parameter and not saved: it is a pure function of the config.
        self.register_buffer("positions", sinusoidal_table(cfg.max_positions, cfg.d_model), persistent=False)
        self.dropout = nn.Dropout(cfg.dropout)
        layer = nn.TransformerEncoderLayer(
            d_model=cfg.d_model,
            nhead=cfg.n_heads,
            dim_feedforward=cfg.d_ff,
            dropout=cfg.dropout,
            batch_first=True,
        )
        # enable_nested_tensor=False: the nested fast path changes padded outputs and breaks ONNX export.
        self.layers = nn.TransformerEncoder(layer, num_layers=cfg.n_layers, enable_nested_tensor=False)
        self._masks: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # causal masks, see _causal_mask

    def forward(self, input_ids: torch.Tensor, padding_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """(B, T) ids, (B, T) bool or None (no padding) -> (B, T, d) hidden states; with `causal`, the outputs at
        <pad> positions are unspecified (no head reads them)."""
        T = input_ids.shape[1]
        x = self.embedding(input_ids) * math.sqrt(self.cfg.d_model)  # (B, T, d)
        # Buffers follow the activations' dtype (bf16 under DeepSpeed casts parameters, not buffers).
        x = self.dropout(x + self.positions[:T].to(x.dtype))
        if torch.compiler.is_exporting():
            return self._exported(x, padding_mask, causal)
        if causal:
            # Right padding: real position t attends to 0..t, all real, so a padding mask would change only the
            # outputs at <pad> positions. Without one, attention is plain causal (is_causal=True reaches SDPA as
            # is_causal, the mask is dropped), which PyTorch runs with its flash / memory-efficient kernels on a GPU;
            # a float padding mask merged into the causal one kept it on the others. The cached mask is only what
            # nn.TransformerEncoder requires beside the flag (and what its inference fast path applies).
            return self.layers(x, mask=self._causal_mask(T, x), is_causal=True)
        if padding_mask is None:  # full windows (packed pretraining): no mask at all
            return self.layers(x)
        return self.layers(x, src_key_padding_mask=padding_mask)  # (B, T) bool, True at <pad>

    def _causal_mask(self, T: int, x: torch.Tensor) -> torch.Tensor:
        """(T, T) additive causal mask in x's dtype, from a cache per (dtype, device) grown to the longest T seen
        (not a buffer: not saved, not moved by .to(); torch.compile builds it in its graph instead)."""
        if torch.compiler.is_compiling():
            return causal_mask(T, x.dtype, x.device)
        key = (x.dtype, x.device)
        cached = self._masks.get(key)
        if cached is None or cached.shape[0] < T:
            cached = self._masks[key] = causal_mask(T, x.dtype, x.device)
        return cached if cached.shape[0] == T else cached[:T, :T]

    def _exported(self, x: torch.Tensor, padding_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """The graph the ONNX exporter records, as it always has: an additive float padding mask, plus the causal mask
        of the model's own T (symbolic in the export), so bundles keep their graph and onnxruntime's fused Attention
        (trainer/model/onnx_attention.py) still reads the padding mask. Both masks are in the activations' dtype: mixing
        a float causal mask with a bool padding mask is deprecated. A row is never fully masked: position 0 (<sos>) is
        always real."""
        T = x.shape[1]
        if padding_mask is None:
            padding_mask = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)
        neg = torch.finfo(x.dtype).min
        pad = torch.zeros(padding_mask.shape, dtype=x.dtype, device=x.device).masked_fill(padding_mask, neg)  # (B, T)
        attn = causal_mask(T, x.dtype, x.device) if causal else None  # (T, T)
        return self.layers(x, mask=attn, src_key_padding_mask=pad, is_causal=False)


def causal_mask(T: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(T, T) additive mask: 0 on and below the diagonal, -inf (dtype min) above: token t sees 0..t."""
    upper = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(T, T, dtype=dtype, device=device).masked_fill(upper, torch.finfo(dtype).min)


def _init_head(head: nn.Linear) -> nn.Linear:
    # The lab's head init: weight uniform(-0.1, 0.1), bias zero.
    nn.init.uniform_(head.weight, -0.1, 0.1)
    nn.init.zeros_(head.bias)
    return head


class LanguageModel(nn.Module):
    """Encoder + d -> V head. `causal=True` for next-token LM; the masked-LM objective passes False."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.head = _init_head(nn.Linear(cfg.d_model, cfg.vocab_size))

    def forward(self, input_ids: torch.Tensor, padding_mask: torch.Tensor | None, causal: bool = True) -> torch.Tensor:
        """(B, T), (B, T) or None -> (B, T, V) logits."""
        return self.head(self.encoder(input_ids, padding_mask, causal))


class MeanPool(nn.Module):
    """The mean of the real positions' outputs. No parameters: the export swaps it for the same mean summed in a
    fixed order (trainer/model/onnx_pooling.py)."""

    def forward(self, h: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        """(B, T, d), (B, T) True at <pad> -> (B, d)."""
        real = (~padding_mask).unsqueeze(-1).to(h.dtype)  # (B, T, 1)
        return (h * real).sum(dim=1) / real.sum(dim=1).clamp(min=1.0)


class Classifier(nn.Module):
    """Encoder + d -> C head on the last real token of each sequence (the lab read the last position), or on the
    mean of the real tokens' outputs (`pooling="mean"`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        # A next-token LM trains the <eos> output to predict what follows a document, the same for every review; the
        # mean of all real positions carries what the encoder learned about the text itself.
        self.pool = MeanPool() if cfg.pooling == "mean" else None
        self.head = _init_head(nn.Linear(cfg.d_model, cfg.num_classes))
        # The logits are divided by it: a calibration fitted on validation after training (trainer/calibration.py),
        # set from the artifact; 1 while training. A constant in an exported graph.
        self.temperature = 1.0

    def forward(self, input_ids: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        """(B, T), (B, T) -> (B, C) logits (divided by `temperature`)."""
        h = self.encoder(input_ids, padding_mask, self.cfg.classifier_causal)  # (B, T, d)
        if self.pool is not None:
            pooled = self.pool(h, padding_mask)  # (B, d)
        else:
            last = (~padding_mask).sum(dim=1) - 1  # (B,) index of the last real token
            pooled = h[torch.arange(h.shape[0], device=h.device), last]  # (B, d)
        logits = self.head(pooled)  # (B, C)
        return logits if self.temperature == 1.0 else logits / self.temperature


def build(cfg: ModelConfig, task: str) -> LanguageModel | Classifier:
    """task: "lm" or "classifier"."""
    if task == "lm":
        return LanguageModel(cfg)
    if task == "classifier":
        return Classifier(cfg)
    raise ValueError(f"unknown task {task!r}; expected 'lm' or 'classifier'")


def load_encoder(model: nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """Copy `encoder.*` weights from a state dict (e.g. a pretrained LM) into `model`; the head stays new.
    Returns the keys copied. Raises ValueError naming the first missing or mis-shaped key."""
    own = model.state_dict()
    keys = [k for k in own if k.startswith("encoder.")]
    for k in keys:
        if k not in state:
            raise ValueError(f"pretrained weights lack {k!r} (found {len(state)} keys)")
        if state[k].shape != own[k].shape:
            raise ValueError(f"{k}: pretrained shape {tuple(state[k].shape)} != model shape {tuple(own[k].shape)}")
    model.load_state_dict({k: state[k] for k in keys}, strict=False)
    return keys


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def parameter_formula(cfg: ModelConfig, task: str) -> dict[str, int]:
    """Closed-form trainable parameter counts, by part (`python -m trainer params` checks them against the model)."""
    d, f, V = cfg.d_model, cfg.d_ff, cfg.vocab_size
    per_layer = {
        "attention in-proj": 3 * d * d + 3 * d,
        "attention out-proj": d * d + d,
        "feed-forward": (d * f + f) + (f * d + d),
        "layer norms": 2 * 2 * d,
    }
    out = {"embedding": V * d}
    out.update({f"{k} (x{cfg.n_layers})": v * cfg.n_layers for k, v in per_layer.items()})
    out["head"] = d * V + V if task == "lm" else d * cfg.num_classes + cfg.num_classes
    return out


def forward_flops_per_token(cfg: ModelConfig, task: str, seq_len: int) -> float:
    """FLOPs of one forward pass per token at sequence length `seq_len`: 2 x the matmul weights a token goes through
    (per layer QKV 3d^2, output d^2, feed-forward 2 d ff; the LM head d V) + 4 L d T for the QK^T and AV products.
    Not counted: embedding lookups, biases, norms, softmax, the classifier head (once per sequence). A training
    step (forward + backward) is 3x this."""
    d, f, L = cfg.d_model, cfg.d_ff, cfg.n_layers
    matmul = L * (3 * d * d + d * d + 2 * d * f) + (d * cfg.vocab_size if task == "lm" else 0)
    return float(2 * matmul + 4 * L * d * seq_len)
