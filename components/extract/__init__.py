"""Room extract (stage 2): the target's fused hidden states and teacher signal, as feature shards.

The stage, its manifest, resume and Ray workers (stage), the same shards computed by vLLM (engine), and the shard
file both write (feature_shards). Nothing is re-exported here: import the module.
"""
