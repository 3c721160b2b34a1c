"""Models the benchmarks and tests build: tiny random-weight models with transformers' greedy
answer, and random checkpoints of real models' shapes."""
