"""CPU kernels: the C++ extension (``cpu_ext``, sources in ``csrc/``) and ``PackedLinear``, a
linear whose weight lives in a CPU kernel's format."""
