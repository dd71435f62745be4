"""The training engine: ranks, DeepSpeed (accelerator.py: the only `import deepspeed`), its JSON, the optimizer and
lr schedule, precision, checkpoints, the loop."""
