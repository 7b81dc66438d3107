"""LoRA kernels: the pure-torch reference (:mod:`.reference`) and the Triton kernels
(:mod:`.triton_kernels`, configured by :mod:`.triton_config`, launched by
:mod:`.triton_launch`). :mod:`lora_graph.ops` registers them as custom ops."""
