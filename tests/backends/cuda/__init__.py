"""The CUDA kernels and the cupy backend without a GPU (NVRTC compiles, launch planners, a fake
CuPy over host memory), and the CPU side of the GPU check script."""
