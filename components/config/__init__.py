"""Room config: one config for a whole pipeline run, made of the stages' own sections.

`PipelineConfig` with its strict loader and fingerprint (pipeline) and the named presets (presets). The one room that
imports every stage (each stage keeps its own `<Stage>Config` beside its function). Nothing is re-exported here.
"""
