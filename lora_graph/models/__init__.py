"""Model architectures as plain ``torch.nn`` modules and their configs, importable as
``lora_graph.models``: each file imports the layers, attention and routing below it and
nothing from the runner (:mod:`lora_graph.pipeline`); the pipelines serving them are in
:mod:`lora_graph.architectures`."""
