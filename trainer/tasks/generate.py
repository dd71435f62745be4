"""Greedy completion of prompts with a pretrained causal LM artifact (the lab's task 5).

The prompt is encoded as [<sos>] + pieces (no <eos>, cut at the artifact's tokenizer.max_len); the most likely next
token is appended until the model emits <eos>, --max-new-tokens ids were generated, or the sequence fills the
model's positions (model.max_positions). Needs no DeepSpeed: it reads the artifact only.
"""

from __future__ import annotations

import argparse

import torch

from trainer import artifact
from trainer.artifact import ArtifactError
from trainer.data.tokenizer import Tokenizer
from trainer.model.encoder import LanguageModel

EXAMPLES = """examples:
  python -m trainer generate runs/demo/pretrain/artifact "Ce livre est"
  python -m trainer generate runs/demo/pretrain/artifact "Il était une fois" "Je n'ai pas aimé" --max-new-tokens 40
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact", help="pretraining artifact folder (task lm, objective clm)")
    parser.add_argument("prompts", nargs="+", help="text(s) to complete")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                        help="stop after N generated ids, the prompt not counted (default 64)")
    # The earlier --max-len counted the prompt too: refused with the new name rather than read as another number.
    parser.add_argument("--max-len", "--max_len", dest="max_len", type=int, help=argparse.SUPPRESS)


@torch.no_grad()
def complete(model: LanguageModel, tok: Tokenizer, prompt: str, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids): greedy, one token at a time, stopping at <eos>, after `max_new_tokens` ids, or
    when the sequence fills model.max_positions."""
    ids = tok.encode(prompt)[:-1]  # [<sos>] + pieces: the model continues after them
    prompt_ids = list(ids)
    limit = min(len(ids) + max_new_tokens, model.cfg.max_positions)
    while len(ids) < limit:
        x = torch.tensor([ids], dtype=torch.int64)  # (1, T)
        logits = model(x, torch.zeros_like(x, dtype=torch.bool), causal=True)  # (1, T, V)
        nxt = int(logits[0, -1].argmax())
        ids.append(nxt)
        if nxt == Tokenizer.EOS:
            break
    return prompt_ids, ids[len(prompt_ids):]


def main(args: argparse.Namespace) -> int:
    if args.max_len is not None:
        raise ValueError(f"--max-len {args.max_len}: renamed --max-new-tokens N, which counts the generated ids only "
                         "(--max-len counted the prompt too)")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    art = artifact.load(args.artifact)
    if art.task != "lm":
        raise ArtifactError(f"{art.path}: task {art.task!r}; generation needs a language-model artifact (task 'lm')")
    if art.meta.get("objective") == "mlm":
        raise ArtifactError(f"{art.path}: a masked-LM encoder (objective mlm) was never trained to predict the next "
                            "token; generate with a clm artifact")
    model = art.model()
    tok = art.tokenizer()
    for prompt in args.prompts:
        _, new = complete(model, tok, prompt, args.max_new_tokens)
        if new and new[-1] == Tokenizer.EOS:
            ended = "<eos>"
        elif len(new) == args.max_new_tokens:
            ended = f"(--max-new-tokens {args.max_new_tokens})"
        else:
            ended = f"(model.max_positions {model.cfg.max_positions})"
        print(f"{prompt} \u2192 {tok.decode(new)} {ended}")
    return 0
