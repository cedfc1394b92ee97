"""One packed forward on the device: its inputs (``step_inputs``, ``mixed_inputs``), the
persistent input buffers (``model_state``), CUDA graphs (``cuda_graphs``) and what a model needs
besides its weights (``device_stack``). Shared by the runner and the draft speculator."""
