"""dlgs benchmarks: selection kernels, training jobs, and the data they use."""
