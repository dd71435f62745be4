"""Print the trainable parameters of the encoder with each head, per module, and the closed-form total.

At the lab's size (`--preset lab`) this prints 21,018,401 (language model) and 10,968,602 (classifier); the table in
README.md quotes both.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict

from torch import nn

from trainer.config.choice import add_config_args, config_choice
from trainer.config.schema import ModelConfig
from trainer.model.encoder import build, count_parameters, parameter_formula

EXAMPLES = """examples:
  python -m trainer params --preset lab
  python -m trainer params --preset tiny --set model.d_model=64
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, default_preset="lab")


def module_table(model: nn.Module) -> OrderedDict[str, int]:
    """Trainable parameters by module path (leaf modules that own parameters)."""
    rows: OrderedDict[str, int] = OrderedDict()
    for name, p in model.named_parameters():
        if p.requires_grad:
            owner = name.rsplit(".", 1)[0]
            rows[owner] = rows.get(owner, 0) + p.numel()
    return rows


def report(cfg: ModelConfig, task: str) -> tuple[str, int, int]:
    """Returns (text table, counted total, formula total)."""
    model = build(cfg, task)
    counted = count_parameters(model)
    formula = parameter_formula(cfg, task)
    width = max(len(k) for k in module_table(model)) + 2
    lines = [f"{'module':<{width}}{'parameters':>14}"]
    lines += [f"{k:<{width}}{v:>14,}" for k, v in module_table(model).items()]
    lines += ["", "closed form:"]
    lines += [f"  {k:<{width - 2}}{v:>14,}" for k, v in formula.items()]
    total = sum(formula.values())
    lines += [f"{'total (counted)':<{width}}{counted:>14,}", f"{'total (formula)':<{width}}{total:>14,}"]
    return "\n".join(lines), counted, total


def main(args: argparse.Namespace) -> int:
    cfg = config_choice(args).resolve().model
    print(f"model: vocab {cfg.vocab_size:,}, d {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, "
          f"feed-forward {cfg.d_ff}, {cfg.num_classes} classes\n")
    ok = True
    for task, title in (("lm", "language model"), ("classifier", "classifier")):
        text, counted, total = report(cfg, task)
        print(f"== {title} ==\n{text}\n")
        ok &= counted == total
    if not ok:
        print("error: counted parameters differ from the closed form")
        return 1
    return 0
