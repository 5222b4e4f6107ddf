"""Room evaluate (stage 4): a head measured on held-out traffic, in our decoder and in vLLM.

Our decoder's evaluation (stage: `EvaluateConfig`, `HeadEval`), the same head served by vLLM (engine), the speedup
figure both trust (speed), the head under load and its K schedule (load_sweep, its settings: load_config), the shadow
test of a retrain on served traffic (shadow) and the plots (plots). Nothing is re-exported here: import the module.
"""
