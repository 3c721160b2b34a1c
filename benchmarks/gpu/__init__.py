"""The GPU check's steps (`orcaserve-bench gpu STEP`, run by benchmarks/gpu_check.sh): the engine
on CUDA, the Triton kernels' timings, CUDA graphs, the fused kernels, start-up costs."""
