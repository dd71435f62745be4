"""The stages a user runs: pretrain, finetune (one run or --compare), generate, predict."""
