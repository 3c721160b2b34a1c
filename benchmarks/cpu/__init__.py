"""The CPU kernels: GEMM timings (`orcaserve-bench kernels`) and the quality of int8 activations
(`orcaserve-bench quality`)."""
