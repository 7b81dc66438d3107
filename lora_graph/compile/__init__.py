"""Capture keys and the graph cache, importable as ``lora_graph.compile``."""
