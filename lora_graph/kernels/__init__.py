"""LoRA kernels: the pure-torch reference (:mod:`.reference`) and the Triton kernels
(:mod:`.triton_kernels`, configured by :mod:`.triton_config`, launched by
:mod:`.triton_launchers` and :mod:`.triton_delta`, implementing the ops in
:mod:`.triton_launch`); the kernel policy (:mod:`.policy`). :mod:`lora_graph.ops` registers
them as custom ops and picks each layer's path by the policy."""
