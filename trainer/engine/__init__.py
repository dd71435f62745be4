"""The training engine: ranks, DeepSpeed (the only `import deepspeed`), precision, schedule, checkpoints, the loop."""
