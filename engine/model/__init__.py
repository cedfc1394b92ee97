"""Model code: the Llama-family decoder (``llama``), its configuration and ``random:`` presets,
attention over the paged KV cache, fused q/k/v and gate/up linears, and the CPU weight formats
with their forward (``cpu_weights``, ``woq_forward``)."""
