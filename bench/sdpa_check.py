"""Which scaled-dot-product-attention kernels the encoder reaches on a CUDA GPU, and whether its outputs match.

For a preset's model (--preset: lab by default; gpu, whose head dimension is 64) in bf16, training mode (as
DeepSpeed runs it; dropout 0 so runs compare), three attention paths of trainer/model/encoder.py's Encoder:
  - causal, no padding mask (next-token pretraining and the causal classifier: `is_causal` reaches SDPA),
  - bidirectional, no padding mask (packed masked-LM windows),
  - bidirectional with a bool padding mask (padded batches),
each run with PyTorch's SDPA restricted to one backend at a time (flash, memory-efficient, cuDNN, math). A backend
that cannot take the path raises "No available kernel"; the table says which ran, and how far each output is from
the math kernel's (bf16: about 1e-2). Also the same model in fp32 on CPU against the GPU's math kernel, so the
check covers the device too.

    python bench/sdpa_check.py [--preset gpu] [--json FILE]     # needs a CUDA GPU; prints a Markdown table
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.config.presets import PRESETS
from trainer.model.encoder import LanguageModel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--preset", default="lab", choices=sorted(PRESETS), help="whose model (default: lab)")
    p.add_argument("--batch", type=int, default=8, help="sequences per batch")
    p.add_argument("--seq", type=int, default=512, help="sequence length in ids")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("sdpa_check: no CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    cfg = PRESETS[args.preset]().model
    cpu_model = LanguageModel(cfg).train()
    model = LanguageModel(cfg).cuda().to(torch.bfloat16).train()
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in cpu_model.state_dict().items()})
    B, T = args.batch, args.seq
    ids = torch.randint(4, cfg.vocab_size, (B, T))
    lengths = torch.randint(T // 4, T + 1, (B,))
    pad = torch.arange(T)[None, :] >= lengths[:, None]  # (B, T) True at <pad>
    ids = ids.masked_fill(pad, cfg.pad_id)
    paths = {"causal, no mask": (None, True), "bidirectional, no mask": (None, False),
             "bidirectional, bool padding mask": (pad, False)}
    rows = []
    for path, (mask, causal) in paths.items():
        gpu_mask = None if mask is None else mask.cuda()
        outs: dict[str, torch.Tensor | str] = {}
        for name, backend in BACKENDS.items():
            try:
                with torch.no_grad(), sdpa_kernel([backend]):
                    outs[name] = model(ids.cuda(), gpu_mask, causal).float()
                torch.cuda.synchronize()
            except RuntimeError as e:
                outs[name] = str(e).split("\n")[0][:80]
        with torch.no_grad():
            ref_cpu = cpu_model(ids, mask, causal)  # fp32, CPU, its default kernel
        real = ~pad if mask is not None else torch.ones_like(pad)  # compare real positions (pad rows are free)
        math = outs["math"]
        for name, out in outs.items():
            if isinstance(out, str):
                rows.append({"path": path, "backend": name, "ran": False, "why": out})
                continue
            diff = (out - math)[real.cuda()].abs().max().item() if isinstance(math, torch.Tensor) else None
            cpu_diff = (out.cpu() - ref_cpu)[real].abs().max().item()
            rows.append({"path": path, "backend": name, "ran": True, "max_abs_diff_vs_math": diff,
                         "max_abs_diff_vs_cpu_fp32": cpu_diff})
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.preset} model bf16 (head dimension "
          f"{cfg.d_model // cfg.n_heads}), batch {B} x {T}")
    print("| path | backend | ran | max abs diff vs math (bf16) | vs CPU fp32 |")
    print("|---|---|---|---:|---:|")
    for r in rows:
        if r["ran"]:
            d = r["max_abs_diff_vs_math"]
            print(f"| {r['path']} | {r['backend']} | yes | {'' if d is None else f'{d:.3g}'} | "
                  f"{r['max_abs_diff_vs_cpu_fp32']:.3g} |")
        else:
            print(f"| {r['path']} | {r['backend']} | no: {r['why']} | | |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
