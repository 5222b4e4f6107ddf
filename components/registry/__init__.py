"""Room registry (stage 5): heads and targets in the MLflow registry, lineage and the promotion gate.

Registration and its gates (register) and, when a run trains several head variants, which one to register
(variant_choice). Nothing is re-exported here: import the module.
"""
