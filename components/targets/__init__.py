"""Room targets: the target model as every stage takes it, and where it runs.

A target directory checked, loaded and read by tensor name (target), a GGUF file converted to one (gguf), where the
target runs, this process or vLLM with its scale (runtime: `TargetRuntime`), and a head as an engine loads it beside
the target (servable). Imports no stage room. Nothing is re-exported here: import the module.
"""
