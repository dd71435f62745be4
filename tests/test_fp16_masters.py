"""DeepSpeed's own fp16 mode (a user's JSON enabling "fp16"): the artifact's weights are the optimizer's fp32
masters, not the module's fp16 copies (trainer/engine/deepspeed_engine.py, fp32_state_dict). DeepSpeed declines fp16
on its CPU accelerator by a capability flag (`is_fp16_supported`, checked once in the engine's sanity check); with
the flag set, its real engine and fp16 optimizers (loss scaling, master weights) run here, in a process of their own
(deepspeed.initialize starts a process group)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from procs import REPO, env, free_port

SCRIPT = r"""
import json, os, sys, tempfile
import torch
import trainer.engine.deepspeed_engine as eng
import deepspeed
from deepspeed.accelerator import get_accelerator

get_accelerator().is_fp16_supported = lambda: True  # the one refusal; all else is DeepSpeed's own CPU path
eng.init_distributed()  # as the trainers start a rank (DeepSpeed's own start would also build its shm op on a CPU)
stage = int(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
config = {"train_micro_batch_size_per_gpu": 5, "fp16": {"enabled": True, "initial_scale_power": 4},
          "zero_optimization": {"stage": stage},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
for _ in range(3):  # 3 steps of lr 1e-2: masters move by amounts fp16 cannot hold
    loss = engine(torch.randn(5, 13).half()).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
folder = tempfile.mkdtemp()
engine.save_checkpoint(folder, tag="t")
weights = eng.fp32_state_dict(engine, folder, "t")
module = {k: v.detach() for k, v in engine.module.state_dict().items()}
print(json.dumps({"optimizer": type(engine.optimizer).__name__,
                  "fp32": all(v.dtype == torch.float32 for v in weights.values()),
                  "module_fp16": all(v.dtype == torch.float16 for v in module.values()),
                  "copies_of_masters": all(torch.equal(weights[k].half(), v) for k, v in module.items()),
                  "finer_than_fp16": any(not torch.equal(w.half().float(), w) for w in weights.values())}))
"""


@pytest.mark.parametrize("stage", [0, pytest.param(2, marks=pytest.mark.slow)])  # about 20 s each
def test_deepspeeds_fp16_mode_exports_the_fp32_masters(stage: int) -> None:
    """ZeRO 0 (the masters whole in DeepSpeed's FP16 optimizer) and ZeRO 2 (partitioned: consolidated from the
    checkpoint): fp32 weights whose fp16 rounding is the module's weights, and finer than fp16. Before, every weight
    was the module's fp16 copy, widened."""
    run_env = {**env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
               "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(stage)], cwd=REPO, env=run_env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["fp32"] and r["module_fp16"] and r["copies_of_masters"], r
    assert r["finer_than_fp16"], r
    assert r["optimizer"] == ("FP16_UnfusedOptimizer" if stage == 0 else "DeepSpeedZeroOptimizer"), r
