"""The lab's model: exact parameter counts, padding and causal invariance, shared encoder keys, bf16 buffers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer.config.presets import lab, tiny
from trainer.config.schema import ModelConfig
from trainer.model.encoder import (
    Classifier,
    LanguageModel,
    build,
    count_parameters,
    load_encoder,
    parameter_formula,
)
from trainer.model.params import report


def test_lab_parameter_counts_match_the_lab_exactly():
    cfg = lab().model
    assert count_parameters(build(cfg, "lm")) == 21_018_401
    assert count_parameters(build(cfg, "classifier")) == 10_968_602
    assert sum(parameter_formula(cfg, "lm").values()) == 21_018_401
    assert sum(parameter_formula(cfg, "classifier").values()) == 10_968_602
    assert parameter_formula(cfg, "lm")["embedding"] == 10_000_200


@pytest.mark.parametrize(
    "sizes",
    [
        dict(vocab_size=99, d_model=32, n_layers=2, n_heads=2, d_ff=48),
        dict(vocab_size=1001, d_model=30, n_layers=3, n_heads=5, d_ff=7, num_classes=3),
        dict(vocab_size=7, d_model=8, n_layers=1, n_heads=1, d_ff=200, num_classes=5),
    ],
)
def test_formula_matches_the_model_for_other_sizes(sizes):
    cfg = ModelConfig(**sizes)
    for task in ("lm", "classifier"):
        assert count_parameters(build(cfg, task)) == sum(parameter_formula(cfg, task).values())


def test_params_report_prints_the_lab_totals():
    text, counted, total = report(lab().model, "lm")
    assert counted == total == 21_018_401
    assert "21,018,401" in text


def _batch(cfg: ModelConfig, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(4, cfg.vocab_size, (len(lengths), T), generator=g)
    ids[:, 0] = 0  # <sos>
    mask = torch.arange(T)[None, :] >= torch.tensor(lengths)[:, None]  # (B, T) True at padding
    ids[mask] = cfg.pad_id
    return ids, mask


@pytest.mark.parametrize("causal,pooling", [(True, "last"), (False, "last"), (True, "mean"), (False, "mean")])
def test_classifier_logits_do_not_change_when_batched_with_longer_sequences(causal, pooling):
    cfg = ModelConfig(**{**tiny().model.__dict__, "classifier_causal": causal, "pooling": pooling})
    torch.manual_seed(0)
    model = Classifier(cfg).eval()
    ids, mask = _batch(cfg, [7, 3, 5, 1])
    batched = model(ids, mask)  # (4, C)
    for i, n in enumerate([7, 3, 5, 1]):
        alone = model(ids[i : i + 1, :n], mask[i : i + 1, :n])
        torch.testing.assert_close(batched[i : i + 1], alone, atol=1e-5, rtol=0)


def test_lm_logits_of_real_tokens_do_not_depend_on_padding():
    cfg = tiny().model
    torch.manual_seed(0)
    model = LanguageModel(cfg).eval()
    ids, mask = _batch(cfg, [7, 4])
    batched = model(ids, mask)  # (2, 7, V)
    alone = model(ids[1:, :4], mask[1:, :4])
    torch.testing.assert_close(batched[1:, :4], alone, atol=1e-5, rtol=0)


def test_causal_lm_position_t_ignores_tokens_after_t():
    cfg = tiny().model
    torch.manual_seed(0)
    model = LanguageModel(cfg).eval()
    ids, mask = _batch(cfg, [7])
    changed = ids.clone()
    changed[0, 4:] = (changed[0, 4:] + 1 - 4) % (cfg.vocab_size - 4) + 4  # new tokens after t=3
    a, b = model(ids, mask), model(changed, mask)
    torch.testing.assert_close(a[:, :4], b[:, :4], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 4:], b[:, 4:])  # the test can fail: later positions do change


def test_bidirectional_encoder_does_see_the_future():
    cfg = tiny().model
    torch.manual_seed(0)
    model = LanguageModel(cfg).eval()
    ids, mask = _batch(cfg, [7])
    changed = ids.clone()
    changed[0, 6] = 5 if ids[0, 6] != 5 else 6
    assert not torch.allclose(model(ids, mask, causal=False)[:, 0], model(changed, mask, causal=False)[:, 0])


def test_classifier_reads_the_last_real_token_not_the_last_position():
    cfg = tiny().model
    torch.manual_seed(0)
    model = Classifier(cfg).eval()
    ids, mask = _batch(cfg, [3, 7])
    out = model(ids, mask)
    ids2 = ids.clone()
    ids2[0, 3:] = 50  # garbage in padded positions must not matter
    torch.testing.assert_close(out, model(ids2, mask), atol=1e-6, rtol=0)


def test_mean_pooling_is_the_mean_of_the_real_positions():
    cfg = ModelConfig(**{**tiny().model.__dict__, "pooling": "mean"})
    torch.manual_seed(0)
    model = Classifier(cfg).eval()
    ids, mask = _batch(cfg, [3, 7])
    h = model.encoder(ids, mask, cfg.classifier_causal)  # (2, 7, d)
    expected = model.head(torch.stack([h[0, :3].mean(0), h[1, :7].mean(0)]))
    torch.testing.assert_close(model(ids, mask), expected, atol=1e-6, rtol=0)
    last = Classifier(ModelConfig(**{**cfg.__dict__, "pooling": "last"})).eval()
    last.load_state_dict(model.state_dict())
    assert not torch.allclose(last(ids, mask), expected)  # the two poolings really differ


def test_classifier_loads_a_pretrained_encoder_by_key():
    cfg = tiny().model
    torch.manual_seed(1)
    lm = LanguageModel(cfg)
    torch.manual_seed(2)
    clf = Classifier(cfg)
    keys = load_encoder(clf, lm.state_dict())
    assert keys and all(k.startswith("encoder.") for k in keys)
    for k in keys:
        torch.testing.assert_close(clf.state_dict()[k], lm.state_dict()[k], atol=0, rtol=0)
    assert clf.head.weight.shape == (cfg.num_classes, cfg.d_model)


def test_load_encoder_names_a_mismatched_key():
    small, big = tiny().model, ModelConfig(vocab_size=99, d_model=64, n_layers=2, n_heads=2, d_ff=48)
    with pytest.raises(ValueError, match="encoder.embedding.weight"):
        load_encoder(Classifier(small), LanguageModel(big).state_dict())


def test_bf16_forward_keeps_bf16_activations():
    cfg = tiny().model
    model = Classifier(cfg).to(torch.bfloat16).eval()  # buffers stay fp32, as under DeepSpeed bf16
    model.encoder.positions = model.encoder.positions.float()
    ids, mask = _batch(cfg, [7, 2])
    out = model(ids, mask)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_params_cli_prints_both_lab_totals():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "trainer", "params", "--preset", "lab"],
                         capture_output=True, text=True, check=True).stdout
    assert "21,018,401" in out and "10,968,602" in out


# ---------------------------------------------------------------------------------------------- attention masks


def _forward_before(enc, input_ids: torch.Tensor, padding_mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """Encoder.forward as it was before the masks changed: a float additive padding mask and a causal mask built on
    every call, is_causal=False (the reference the new forward must equal at every position a head reads)."""
    from trainer.model.encoder import causal_mask

    T = input_ids.shape[1]
    x = enc.dropout(enc.embedding(input_ids) * enc.cfg.d_model ** 0.5 + enc.positions[:T].to(torch.float32))
    pad = torch.zeros(padding_mask.shape).masked_fill(padding_mask, torch.finfo(torch.float32).min)
    attn = causal_mask(T, torch.float32, x.device) if causal else None
    return enc.layers(x, mask=attn, src_key_padding_mask=pad, is_causal=False)


@pytest.mark.parametrize("train", [True, False])  # training mode, and eval under no_grad (the fused fast path)
@pytest.mark.parametrize("causal", [True, False])
def test_new_masks_give_the_old_outputs_at_every_real_position(causal: bool, train: bool) -> None:
    cfg = ModelConfig(**{**tiny().model.__dict__, "dropout": 0.0})
    torch.manual_seed(1)
    enc = LanguageModel(cfg).encoder.train(train)
    for lengths in ([13, 7, 1, 13], [9, 9, 9]):  # padded rows, and no padding at all
        ids, pad = _batch(cfg, lengths, seed=len(lengths))
        with torch.set_grad_enabled(train):
            old = _forward_before(enc, ids, pad, causal)
            new = enc(ids, pad, causal)
            real = ~pad
            assert torch.allclose(new[real], old[real], atol=1e-5, rtol=1e-5), (new[real] - old[real]).abs().max()
            if not pad.any():  # no padding: None is the same as an all-False mask
                assert torch.allclose(enc(ids, None, causal), old, atol=1e-5, rtol=1e-5)
    # One cached causal mask, grown to the longest T, serves the shorter ones; bidirectional attention builds none.
    assert [m.shape for m in enc._masks.values()] == ([(13, 13)] if causal else [])


def test_unpadded_attention_reaches_sdpa_without_a_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """What lets SDPA pick its flash / memory-efficient kernels on a GPU: causal attention arrives as is_causal with
    no mask tensor, and full windows of the masked LM arrive with no mask at all; a padded bidirectional batch still
    carries its padding (as a mask)."""
    import torch.nn.functional as F

    seen: list[tuple[bool, bool]] = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        seen.append((attn_mask is None, bool(is_causal)))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    cfg = tiny().model
    enc = LanguageModel(cfg).encoder.train()
    ids, pad = _batch(cfg, [11, 5, 11])
    enc(ids, pad, causal=True)
    assert seen and set(seen) == {(True, True)}  # padded or not, causal attention is plain causal
    seen.clear()
    enc(ids, None, causal=False)
    assert set(seen) == {(True, False)}
    seen.clear()
    enc(ids, pad, causal=False)
    assert set(seen) == {(False, False)}


def test_generate_counts_the_new_tokens_and_stops_at_the_positions(tiny_tokenizer, capsys) -> None:
    """`generate --max-new-tokens N`: N ids after the prompt (HF generate's max_new_tokens), fewer at <eos> or when
    the sequence fills model.max_positions; the earlier --max-len, which counted the prompt too, is refused by name."""
    from trainer.__main__ import main as trainer_cli
    from trainer.tasks.generate import complete

    torch.manual_seed(0)
    cfg = tiny().model
    eos_bias = torch.zeros(cfg.vocab_size)
    eos_bias[tiny_tokenizer.EOS] = -1e4  # random weights: never end early, so the count is the limit's
    model = build(cfg, "lm").eval()
    model.head.bias.data += eos_bias
    prompt, new = complete(model, tiny_tokenizer, "Ce livre est", max_new_tokens=9)
    assert prompt[0] == tiny_tokenizer.SOS and tiny_tokenizer.EOS not in prompt and len(new) == 9
    model.cfg = dataclasses.replace(cfg, max_positions=len(prompt) + 4)  # the table the sequence must fit
    assert len(complete(model, tiny_tokenizer, "Ce livre est", max_new_tokens=9)[1]) == 4
    assert trainer_cli(["generate", "no-artifact", "Ce livre", "--max-len", "12"]) == 2
    assert capsys.readouterr().err == ("error: --max-len 12: renamed --max-new-tokens N, which counts the generated "
                                       "ids only (--max-len counted the prompt too)\n")
