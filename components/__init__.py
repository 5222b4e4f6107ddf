"""The pipeline's stages, one room (subpackage) each, and the shared rooms they import: data/ and targets/.

Rooms: data, targets (shared); config; regenerate, extract, train, evaluate, registry (stages 1-5); serving (the
serving loop). What each holds and may import: ARCHITECTURE.md "Rooms of components/", checked by tests/test_rooms.py.
Nothing is re-exported here: import the module (`from components.extract.stage import extract`).
"""
