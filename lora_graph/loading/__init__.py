"""Reading what the engine serves from disk: the base model's checkpoint
(:mod:`~lora_graph.loading.model_files`), PEFT adapters
(:mod:`~lora_graph.loading.adapter_files`) and their ``adapter_config.json``
(:mod:`~lora_graph.loading.peft_config`)."""
