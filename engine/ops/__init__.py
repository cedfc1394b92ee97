"""Kernels and their host helpers, with no engine state: Triton kernels for CUDA (``triton/``),
the CPU C++ extension and packed linears (``cpu/``), host int lists to tensors
(``host_arrays``)."""
