"""Room serving: the serving loop once a head is registered.

The launch commands of a GPU cluster (launch), vLLM behind our proxy with capture and head swaps (live), the capture
writer (capture), the acceptance monitor that triggers a retrain (monitor) and the rollback of a collapsed head
(rollback). Nothing is re-exported here: import the module.
"""
