"""Room regenerate (stage 1): the target answers the training traffic; its answers are the data.

The stage, its shards, resume and Ray workers (stage), and answering through an OpenAI-compatible server (endpoint).
Nothing is re-exported here: import the module.
"""
