"""Greedy completion of prompts with a pretrained causal LM artifact (the lab's task 5).

The prompt is encoded as [<sos>] + pieces (no <eos>); the most likely next token is appended until the model emits
<eos> or the sequence reaches --max-len ids. Needs no DeepSpeed: it reads the artifact only.
"""

from __future__ import annotations

import argparse

import torch

from trainer import artifact, cli
from trainer.artifact import ArtifactError
from trainer.data.tokenizer import Tokenizer
from trainer.model.encoder import LanguageModel

EXAMPLES = """examples:
  python -m trainer generate runs/demo/pretrain/artifact "Ce livre est"
  python -m trainer generate runs/demo/pretrain/artifact "Il était une fois" "Je n'ai pas aimé" --max-len 40
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact", help="pretraining artifact folder (task lm, objective clm)")
    parser.add_argument("prompts", nargs="+", help="text(s) to complete")
    parser.add_argument("--max-len", type=int, default=64, help="stop at this many ids, prompt included (default 64)")
    cli.old_spelling(parser, "--max_len", "max_len", type=int)


@torch.no_grad()
def complete(model: LanguageModel, tok: Tokenizer, prompt: str, max_len: int) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids): greedy, one token at a time, stopping at <eos> or `max_len` ids in total."""
    limit = min(max_len, model.cfg.max_positions)
    ids = tok.encode(prompt, max_len=limit)[:-1]  # [<sos>] + pieces: the model continues after them
    prompt_ids = list(ids)
    while len(ids) < limit:
        x = torch.tensor([ids], dtype=torch.int64)  # (1, T)
        logits = model(x, torch.zeros_like(x, dtype=torch.bool), causal=True)  # (1, T, V)
        nxt = int(logits[0, -1].argmax())
        ids.append(nxt)
        if nxt == Tokenizer.EOS:
            break
    return prompt_ids, ids[len(prompt_ids):]


def main(args: argparse.Namespace) -> int:
    art = artifact.load(args.artifact)
    if art.task != "lm":
        raise ArtifactError(f"{art.path}: task {art.task!r}; generation needs a language-model artifact (task 'lm')")
    if art.meta.get("objective") == "mlm":
        raise ArtifactError(f"{art.path}: a masked-LM encoder (objective mlm) was never trained to predict the next "
                            "token; generate with a clm artifact")
    if args.max_len < 3:
        raise ValueError(f"--max-len must be >= 3, got {args.max_len}")
    model = art.model()
    tok = art.tokenizer()
    for prompt in args.prompts:
        _, new = complete(model, tok, prompt, args.max_len)
        ended = "<eos>" if new and new[-1] == Tokenizer.EOS else f"(--max-len {args.max_len})"
        print(f"{prompt} \u2192 {tok.decode(new)} {ended}")
    return 0
