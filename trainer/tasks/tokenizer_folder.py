"""A run folder's tokenizer (RUN/tokenizer), shared by pretraining and fine-tuning: built or copied once, then read by
every rank, and checked against the run's config."""

from __future__ import annotations

from pathlib import Path

from trainer.config.schema import ConfigError, RunConfig, check_tokenizer
from trainer.data.tokenizer import Tokenizer, build_tokenizer
from trainer.engine.distributed import file_lock


def run_tokenizer(cfg: RunConfig, run_dir: Path, given: Path | None, texts: list[str] | None = None) -> Tokenizer:
    """RUN_DIR/tokenizer: built once (from `given`, or from the config) by the first rank to take the run folder's
    lock, then read by every rank. A lock, not rank 0 and a barrier: it works before the process group exists, and
    no collective times out while a tokenizer is trained on a large corpus. A trained tokenizer learns
    data.pretrain, else `texts` (fine-tuning: the training split's).

    Its ids must be model.vocab_size; it cuts at tokenizer.max_len (the folder holds no cut)."""
    folder, max_len = run_dir / "tokenizer", cfg.tokenizer.max_len
    with file_lock(run_dir / ".tokenizer.lock"):
        if not folder.exists():
            if given:
                tok = Tokenizer.load(given, max_len)
            elif cfg.tokenizer.kind == "train" and not cfg.data.pretrain and texts:
                tc = cfg.tokenizer
                tok = Tokenizer.train(texts, tc.vocab_size, tc.max_len, tc.train_lines, cfg.seed, tc.case_fold)
            else:
                tok = build_tokenizer(cfg)
            where = f"--tokenizer {given}" if given else "the built tokenizer"
            check_tokenizer(tok.vocab_size, cfg, where)
            check_case(tok, cfg, given or folder)  # before saving: a refused folder is not left in the run
            tok.save(folder)
        elif given and Tokenizer.load(given, max_len).fingerprint != Tokenizer.load(folder, max_len).fingerprint:
            raise ConfigError(f"--tokenizer {given} differs from the run's {folder}; use a new --out")
    tok = Tokenizer.load(folder, max_len)
    check_tokenizer(tok.vocab_size, cfg, str(folder))
    check_case(tok, cfg, folder)
    return tok


def check_case(tok: Tokenizer, cfg: RunConfig, where: Path) -> None:
    """A tokenizer folder decides what is folded (its spm.model's normalizer): the config must say the same."""
    if tok.case_fold != cfg.tokenizer.case_fold:
        raise ConfigError(f"{where}: the tokenizer {'folds' if tok.case_fold else 'keeps'} case but "
                          f"tokenizer.case_fold={cfg.tokenizer.case_fold}; set it to {tok.case_fold}")
