"""The one bad-input error type: every error that means "the input is wrong, fix it" subclasses `BadInput`.

Purpose: the command line (flows/cli.py) maps `BadInput` to exit 2 and one line `eagle-heads: error: <message>`,
and the flows never retry it (flows/tasks.py `transient`: a `ValueError` is not retried, and `BadInput` is one).
Each layer's own errors subclass it: traffic (`TrafficFormatError`), configs (`ConfigError`, `FieldError`),
targets and heads (`TargetError`, `HeadMismatchError`, `HeadFileError`), features (`FeatureStoreError`), the
registry (`RegistryCollision`, `BadModelUri`, `UnknownModel`), settings (`BadSetting`), Ray storage
(`StorageNotShared`), the monitor (`MonitorError`). A message names the input (file, key, URI, flag) and says what
to do; it is one line.
This module imports nothing, so every layer may import it (tests/test_layout.py lets infra/ do so).
Not here: unreachable services (`ConnectionError` subclasses: exit 2 too, but they are outages, retried by the
flows) or the checks themselves (flows/preflight.py gathers them per command).
"""

from __future__ import annotations


class BadInput(ValueError):
    """Input that cannot work as given (an argument, file, URI, setting or config value); the message says which."""
