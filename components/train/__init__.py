"""Room train (stage 3): the draft head trained with TTT, on Ray Train or in this process, resumable.

The stage and its loop (stage), its config sections (config: `TrainConfig`, `RayConfig`), the reader of the extract
stage's output as TTT batches (data), checkpoints and the best weights (state) and the Ray Train run (ray_train).
Nothing is re-exported here: import the module.
"""
