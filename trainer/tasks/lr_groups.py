"""How a pretrained encoder is fine-tuned layer by layer: the classifier's parameters in groups from the top (head,
encoder layers from the last to the first, embedding), each with its share of the schedule's learning rate at every
step (trainer/engine/optimizer.py, LrGroup).

- Layer-wise learning-rate decay (finetune.layer_lr_decay, d): group k from the top trains at lr x d^k (the head at
  lr, the embedding at lr x d^(n_layers + 1)); the lower layers, which hold the most general features, move least.
- Gradual unfreezing (finetune.unfreeze_epochs, u; ULMFiT): group k starts at step round(k x u x steps per epoch);
  before it its share is 0, so Adam leaves its weights exactly as they are (lr 0). Its gradients are still computed;
  at ZeRO 0 with fp32 weights the clipping of the groups that train leaves them out of the norm
  (trainer/engine/deepspeed_engine.py), under ZeRO 1-3 and DeepSpeed's bf16/fp16 modes DeepSpeed clips over all.
A run from scratch has nothing to transfer: every group trains at lr from the first step (`lr_groups` gives None).
"""

from __future__ import annotations

from torch import nn

from trainer.config.schema import FinetuneConfig
from trainer.engine.optimizer import LrGroup


def layer_groups(model: nn.Module) -> list[tuple[str, list[nn.Parameter]]]:
    """(name, parameters) of a Classifier, top down: head, layer{n-1}, ..., layer0, embedding. Every parameter is in
    exactly one group (else AssertionError: a model part this function does not know)."""
    enc = model.encoder
    groups = [("head", list(model.head.parameters()))]
    groups += [(f"layer{i}", list(enc.layers.layers[i].parameters())) for i in reversed(range(len(enc.layers.layers)))]
    groups.append(("embedding", list(enc.embedding.parameters())))
    grouped = [id(p) for _, ps in groups for p in ps]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters()), "a parameter outside the layer groups"
    return groups


def lr_groups(model: nn.Module, fc: FinetuneConfig, steps_per_epoch: int, pretrained: bool) -> list[LrGroup] | None:
    """The optimizer's groups under layer-wise decay and gradual unfreezing; None (one group, every parameter at the
    schedule's lr) from scratch or when neither is set."""
    if not pretrained or (fc.layer_lr_decay == 1.0 and fc.unfreeze_epochs == 0):
        return None
    every = round(fc.unfreeze_epochs * steps_per_epoch)
    return [LrGroup(name, params, fc.layer_lr_decay ** k, k * every)
            for k, (name, params) in enumerate(layer_groups(model))]


def describe(groups: list[LrGroup], lr: float) -> str:
    """"head 0.0001 from step 0, layer1 5e-05 from step 100, ...": each group's peak rate and first step."""
    return ", ".join(f"{g.name} {lr * g.rate:.3g} from step {g.start}" for g in groups)
