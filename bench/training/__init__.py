"""The parts of bench/train_throughput.py: tasks (what is trained), loops (the two loops, timed), report."""
