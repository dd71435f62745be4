"""Named presets: functions that build a RunConfig (`--preset tiny|demo|english|lab|gpu`).

Every preset reads the project's public data sets (trainer/data/sources.py says what each is and where it comes
from; `python -m trainer data fetch` downloads them) from `data_sets()`: the folder `TS_DATA` names, else the user's
cache, $XDG_CACHE_HOME/transfer-sentiment/data (~/.cache/transfer-sentiment/data). Never from where the package is
installed: a wheel installed into a virtualenv has no data beside it.
A user's own data replaces the whole data section (trainer/config/choice.py, Choice.resolve): nothing of it leaks
into their run.
"""

from __future__ import annotations

import dataclasses
import os
import typing

from trainer.config.schema import (
    ConfigError,
    DataConfig,
    EngineConfig,
    FinetuneConfig,
    ModelConfig,
    OptimConfig,
    PretrainConfig,
    RunConfig,
    TokenizerConfig,
)

DATA_ENV = "TS_DATA"


def data_sets() -> str:
    """The absolute folder of the project's data sets: $TS_DATA, else the user's cache (XDG's base directories)."""
    if os.environ.get(DATA_ENV):
        return os.path.abspath(os.path.expanduser(os.environ[DATA_ENV]))
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.abspath(os.path.join(cache, "transfer-sentiment", "data"))


def cls_books(**changes: typing.Any) -> DataConfig:
    """The lab's French book reviews: train 1,600, valid 400 (picks the epoch kept), test 2,000; 0 = negative."""
    base = DataConfig(
        root=data_sets(),
        pretrain=["eltec-fr/eltec_fra.txt.gz", "cls-books-fr/train.review.spm"],
        train="cls-books-fr/train.review.spm",
        valid="cls-books-fr/valid.review.spm",
        test="cls-books-fr/test.review.spm",
        labels=["0", "1"],
        label_names=["negative", "positive"],
        language="fr",
        domain="book reviews (Amazon, the CLS corpus's books category)",
    )
    return dataclasses.replace(base, **changes)


def lab() -> RunConfig:
    """The lab's sizes and schedule: its tokenizer (50,001 ids), d=200, 4 layers; meant for a GPU."""
    return RunConfig(
        preset="lab",
        data=cls_books(),
        pretrain=PretrainConfig(micro_batch=16, seq_len=512, epochs=2, optim=OptimConfig(lr=3e-4)),
        finetune=FinetuneConfig(micro_batch=8, epochs=15, optim=OptimConfig(lr=1e-4)),
    )


def demo() -> RunConfig:
    """The lab's experiment sized for 2 CPU cores (its wall time: docs/BENCHMARKS.md): a trained 8k tokenizer (the
    50k-way LM head is most of the lab's FLOPs), next-token LM as in the lab. Three departures from the lab, whose
    effect docs/RESULTS.md shows: the classifier averages the real positions instead of reading `<eos>` (whose
    next-token target is the same for every review), fine-tuning (only) uses dropout 0.3, and its lr is 4e-4 rather
    than the lab's 1e-4 (both arms, pretrained and from scratch, score higher on every one of 3 seeds), with a
    warm-up and a linear decay (the pretrained arm's best recipe over 3 seeds). Fine-tuning also trains on each
    review's first and last sentence (data.crops), so that one-line reviews are read as well as long ones, and its
    tokenizer folds case, so that a review's capitalised first word is the word it is inside a sentence.

    Pretraining text: the novels of eltec-fr plus the cls-books train reviews listed 8 times (so that in-domain text
    is not a sliver of the pieces); the valid reviews come last, so they are the held-out eval slice."""
    return RunConfig(
        preset="demo",
        model=ModelConfig(vocab_size=8004, d_model=128, n_layers=2, n_heads=2, d_ff=256, max_positions=512,
                          pooling="mean"),
        # case_fold: short reviews 83.33% -> 91.67% on every seed ("Ennuyeux du début à la fin." was read as
        # positive: "Ennuyeux" was 4 pieces, "ennuyeux" 1), test within the noise: docs/RESULTS.md, Behaviour
        tokenizer=TokenizerConfig(kind="train", vocab_size=8000, max_len=256, train_lines=100_000, case_fold=True),
        data=cls_books(
            pretrain=["eltec-fr/eltec_fra.txt.gz", *["cls-books-fr/train.review.txt"] * 8,
                      "cls-books-fr/valid.review.txt"],
            pretrain_eval_lines=400,
            crops=["first", "last"],  # short reviews 62.50% -> 83.33% (kept case), test unchanged: RESULTS, Behaviour
        ),
        # windows as long as a fine-tuning review (256 ids), so that every position the classifier averages was
        # pretrained: 16 a step, the ids a step of 32 x 128 windows held; 1,500 steps keep `make demo` inside its
        # 20 minutes on 2 cores (2,000 took 21 min 40 s: docs/BENCHMARKS.md)
        pretrain=PretrainConfig(
            micro_batch=16,
            seq_len=256,
            epochs=1,
            max_steps=1500,
            optim=OptimConfig(lr=1e-3, warmup_steps=100, schedule="cosine"),
        ),
        # 237 steps an epoch (1,600 reviews + 2,191 crops): the lr rises over 60 steps, then falls linearly to a tenth
        # dropout 0.3 and 6 epochs: the best pretrained mean of dropout 0 to 0.4, and of 6 or 8 epochs, over 3 seeds
        # (docs/RESULTS.md, recipes)
        finetune=FinetuneConfig(micro_batch=16, epochs=6, dropout=0.3,
                                optim=OptimConfig(lr=4e-4, warmup_steps=60, schedule="linear")),
        engine=EngineConfig(checkpoint_every=500),
    )


def english() -> RunConfig:
    """The English pipeline most users run first: a tokenizer trained on IMDB's 50,000 unlabeled reviews,
    next-token pretraining on them (in-domain text), fine-tuning on IMDB train less a stratified 10% that picks the
    epoch kept (IMDB has no validation split), accuracy on IMDB test, and SST-2 dev/test (movie-review sentences)
    scored once at the end with the whole IMDB test set (each epoch scores a seeded 5,000-review sample of it). The
    demo's model size and pooling, dropout 0.1 while fine-tuning at lr 1e-4 with a constant rate (what its
    results were measured with). Pretraining is longer than the demo's, on windows as long as a fine-tuning review
    (256 ids, so every position the classifier averages was pretrained): 10,000 steps of 16 packed windows, 2.45
    passes over the unlabeled text. Wall times, and the comparison with 2,000 steps of 32 windows of 128 and with
    masked-LM pretraining: docs/RESULTS.md."""
    base = demo()  # the same model, tokenizer size and pooling
    return dataclasses.replace(
        base,
        preset="english",
        data=DataConfig(
            root=data_sets(),
            pretrain=["imdb/unsup.txt.gz"],
            pretrain_eval_lines=500,
            train="imdb/train.jsonl.gz",
            valid_split=0.1,
            test="imdb/test.jsonl.gz",
            max_test_examples=5000,  # per epoch: a seeded sample of the test set; all 25,000 once at the end
            extra_test=["imdb/test.jsonl.gz", "sst2/dev.tsv", "sst2/test.tsv"],
            labels=["0", "1"],
            label_names=["negative", "positive"],
            language="en",
            domain="movie reviews (IMDB; SST-2's sentences scored too)",
        ),
        # 65,367 packed windows of 256 ids, 4,085 steps a pass: max_steps ends the run 2.45 passes in (with
        # max_steps set, epochs does not bound the run)
        pretrain=dataclasses.replace(base.pretrain, micro_batch=16, seq_len=256, epochs=2, max_steps=10_000),
        # 22,500 labeled reviews: 2 epochs are 2,814 steps. The baseline: word n-grams only; character n-grams of
        # long reviews cost far more to vectorize (docs/RESULTS.md, the baseline)
        finetune=dataclasses.replace(base.finetune, epochs=2, dropout=0.1, tfidf_baseline="word",
                                     optim=OptimConfig(lr=1e-4)),
        engine=dataclasses.replace(base.engine, checkpoint_every=1000),
    )


def gpu() -> RunConfig:
    """The encoder sized for one H100 or H200 in bf16: 110.2 M parameters with the LM head, 97.6 M as a classifier
    (`python -m trainer params --preset gpu`). d 768, 12 layers of 12 heads: head dimension 64, a multiple of 8, so
    PyTorch's flash, memory-efficient and cuDNN attention kernels all take it (the lab's 100 lets only flash run).
    A 16,384-id tokenizer (16,380 pieces + 4 specials: a multiple of 64, so the LM head's matmul tiles evenly)
    trained on the pretraining text: eltec-fr, then the cls-books train reviews, the valid reviews last (held out
    for the eval loss, as in the demo). Windows of 1,024 ids, 32 per rank per micro-step; bf16 (autocast over fp32
    weights); compiled on CUDA (engine.compile=auto). The recipe of GPT-2-small-sized models
    (nanoGPT): AdamW with betas 0.9/0.95, weight decay 0.1, warm-up then cosine, clipping at 1.0, no dropout while
    pretraining; fine-tuning with mean pooling, as in the demo, and dropout 0.1."""
    return RunConfig(
        preset="gpu",
        model=ModelConfig(vocab_size=16_384, d_model=768, n_layers=12, n_heads=12, d_ff=3072, max_positions=1024,
                          pooling="mean"),
        tokenizer=TokenizerConfig(kind="train", vocab_size=16_380, max_len=512, train_lines=200_000),
        data=cls_books(pretrain=["eltec-fr/eltec_fra.txt.gz", "cls-books-fr/train.review.txt",
                                 "cls-books-fr/valid.review.txt"], pretrain_eval_lines=400),
        pretrain=PretrainConfig(micro_batch=32, seq_len=1024, epochs=2, optim=OptimConfig(
            name="adamw", lr=3e-4, betas=[0.9, 0.95], weight_decay=0.1, grad_clip=1.0, warmup_steps=100,
            schedule="cosine")),
        finetune=FinetuneConfig(micro_batch=32, epochs=4, dropout=0.1, optim=OptimConfig(
            name="adamw", lr=5e-5, weight_decay=0.01, grad_clip=1.0, warmup_steps=10, schedule="linear")),
        engine=EngineConfig(precision="bf16", compile="auto", checkpoint_every=500, log_every=25),
    )


def tiny() -> RunConfig:
    """Seconds, for tests: odd sizes so that shape bugs show (vocab 99 after training 95 pieces)."""
    return RunConfig(
        preset="tiny",
        model=ModelConfig(vocab_size=99, d_model=32, n_layers=2, n_heads=2, d_ff=48, max_positions=64),
        tokenizer=TokenizerConfig(kind="train", vocab_size=95, max_len=48, train_lines=2000),
        data=cls_books(
            pretrain=["cls-books-fr/train.review.txt"],
            pretrain_eval_lines=13,
            max_train_examples=104,
            max_valid_examples=39,
            max_test_examples=39,
        ),
        pretrain=PretrainConfig(micro_batch=13, seq_len=24, epochs=1, max_steps=6, optim=OptimConfig(lr=1e-3)),
        finetune=FinetuneConfig(micro_batch=13, epochs=2, optim=OptimConfig(lr=1e-3)),
    )


PRESETS: dict[str, typing.Callable[[], RunConfig]] = {"tiny": tiny, "demo": demo, "english": english, "lab": lab,
                                                      "gpu": gpu}


def preset(name: str) -> RunConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()


def overrides(cfg: RunConfig) -> dict[str, typing.Any]:
    """The keys where a resolved config differs from its preset's values ("key": value, flat), data.root aside (where
    the data sets are on that machine, not what they are); {} for a preset this code no longer has."""
    from trainer.config.schema import flatten

    if cfg.preset not in PRESETS:
        return {}
    mine, base = flatten(cfg.to_dict()), flatten(preset(cfg.preset).to_dict())
    return {k: v for k, v in mine.items() if k != "data.root" and base.get(k) != v}
