"""Where `ats certify`'s fixed-sequence testing starts by default (`certify_threshold`'s `start_coverage`).

Started at the fewest answers that can certify (0), the sequence's first tests answer a handful of the most
confident questions; when a few of those are wrong it ends there and certifies nothing, however good the rest of the
order is (benchmarks/results/certify_served.md: Qwen2.5-Coder-1.5B's top 10 served answers are half wrong, and no
target risk below 0.9 is certified). Starting at the first threshold answering a fraction s of the questions keeps
the guarantee (s depends on no correctness) and never certifies a threshold answering fewer than s.

s = 0.3 was chosen once by benchmarks/start_coverage.py on served answers that are never reported (the 1.5B model's
answers to 600 other certification questions: the highest held-out coverage averaged over target risks 0.1-0.9)
and then measured on the reported ones (benchmarks/results/start_coverage.md). Its price: a target risk that only
fewer than 30% of the answers can meet is not certified; `--start-coverage 0` (or `choose`: chosen on other answers)
is the choice there. Nothing heavy is imported, so the command line reads it at once.
"""

DEFAULT_START_COVERAGE = 0.3
