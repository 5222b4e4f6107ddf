"""Stage 3 on Ray Train: `fit_with_ray(train_loop, args, storage)` runs the training loop on Ray Train workers (DDP).

Purpose: components/train/stage.py calls it when `train.ray.num_workers` >= 1. One `TorchTrainer` per output directory
(its Ray run named after it), `FailureConfig(max_failures)` restarts of a failed worker group, checkpoints
reported to Ray by the loop. Workers on several hosts must all see the output directory and the checkpoint storage:
checked before training (infra/ray_cluster.py `check_shared_paths`).
Bad input in a worker (`eagle.errors.BadInput`, e.g. a warm-start head that fuses other layers than the features,
found as the worker builds its head): Ray's failure policy restarts the worker group after any worker error
(`FailureConfig` cannot exempt one), and a restarted worker refuses the same input again. A Ray Train callback in
the controller (`RefuseBadInput`) ends the run at the first such error instead (an error raised in a callback
is the controller's own, which it does not retry), and the caller gets the worker's own exception, message and
type, which the CLI prints as its one line (exit 2); Ray's tracebacks of it (worker and controller) are dropped.
A run's placement groups are removed when `fit` returns or raises (`groups_released`): Ray Train's cleaner can miss
one (a worker group of 2 x 1 CPU was left on a test session's local Ray), and the next run in the same Ray then waits
for those CPUs forever (its controller retries a worker group it cannot place without limit).
Run: through `components.train.stage.train`; tests/test_bad_input_stages.py (a refusal in a worker),
test_extract_train.py (restarts). Not here: the loop itself (components/train/loop.py), Ray sessions
(infra/ray_cluster.py).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
from pathlib import Path
from typing import Any, Callable, Iterator

from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig, TrainingFailedError, UserCallback
from ray.train.torch import TorchTrainer

from eagle.errors import BadInput
from infra.ray_cluster import check_shared_paths


def _ray_run_name(out_dir: str) -> str:
    """One Ray run per output directory: the flows share one storage path and name every output dir `train`."""
    return f"{Path(out_dir).name}-{hashlib.sha256(str(Path(out_dir).resolve()).encode()).hexdigest()[:12]}"


def fit_with_ray(loop: Callable[[Any], None], args: Any, storage: str) -> None:
    """`loop(args)` (components.train.loop's `train_loop` and its `LoopArgs`) on `args.cfg.ray.num_workers` Ray Train
    workers. A worker's `BadInput` reaches the caller as itself, with the worker's message, without a restart of
    the worker group (`RefuseBadInput`); any other failure is retried `max_failures` times, then raised as Ray's
    error (`WorkerGroupError`, `ControllerError`)."""
    cfg = args.cfg.ray
    storage = storage if "://" in storage else str(Path(storage).resolve())  # a URI (s3://, file://) as it is
    check_shared_paths({"the checkpoint storage": storage, "the output directory": args.out_dir})  # workers span hosts
    trainer = TorchTrainer(
        functools.partial(_worker_loop, loop),
        train_loop_config=args,
        scaling_config=ScalingConfig(
            num_workers=cfg.num_workers, use_gpu=cfg.use_gpu, resources_per_worker={"CPU": cfg.cpus_per_worker}
        ),
        run_config=RunConfig(
            name=_ray_run_name(args.out_dir),
            storage_path=storage,
            failure_config=FailureConfig(max_failures=cfg.max_failures),
            logging_config=LoggingConfig(log_level="WARNING"),  # no INFO lines per worker start
            callbacks=[RefuseBadInput()],
        ),
    )
    try:
        with groups_released():
            trainer.fit()  # raises the run's TrainingFailedError when it fails
    except TrainingFailedError as e:
        bad = _worker_bad_input(e)
        if bad is None:
            raise
        raise bad from None  # the worker's own error and message; Ray's wrapping adds nothing for the user


@contextlib.contextmanager
def groups_released() -> Iterator[None]:
    """When the block ends, remove the placement groups created in it that Ray has not removed (placed or pending):
    runs in this process are sequential, so none is in use once the block's run ended. Groups that existed before
    the block are left alone. No-op where Ray is not initialised here."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    before = set(ray.util.placement_group_table()) if ray.is_initialized() else None
    try:
        yield
    finally:
        if before is not None and ray.is_initialized():
            for k, v in ray.util.placement_group_table().items():
                if k not in before and v.get("state") != "REMOVED":
                    remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(k))))


# Ray Train's loggers that report a failure with a traceback: the worker's ("Error in training function") and the
# controller's ("Error in control loop iteration", for the error `RefuseBadInput` raises). For a `BadInput` both
# are dropped: the caller raises it, and the CLI prints its message as one line.
RAY_WORKER_ERROR_LOGGER = "ray.train.v2._internal.util"
RAY_CONTROLLER_LOGGER = "ray.train.v2._internal.execution.controller.controller"


def _worker_loop(loop: Callable[[Any], None], args: Any) -> None:
    """`loop(args)` in a Ray Train worker; a `BadInput` leaves without Ray's traceback of it."""
    try:
        loop(args)
    except BadInput:
        logging.getLogger(RAY_WORKER_ERROR_LOGGER).addFilter(_not_a_training_function_error)
        raise


def _not_a_training_function_error(record: logging.LogRecord) -> bool:
    """A logging filter: Ray's report of the training function's error does not pass."""
    return not record.getMessage().startswith("Error in training function")


def _not_bad_input(record: logging.LogRecord) -> bool:
    """A logging filter: a record of a `BadInput` exception does not pass."""
    return not (record.exc_info and isinstance(record.exc_info[1], BadInput))


def _worker_bad_input(error: BaseException) -> BaseException | None:
    """The `BadInput` a worker raised, in the run's `TrainingFailedError`: the error `RefuseBadInput` raised in
    the controller (`ControllerError.controller_failure`), or a worker's (`WorkerGroupError.worker_failures`, for a
    Ray whose controller retries it anyway); None for any other failure."""
    found = [getattr(error, "controller_failure", None), *getattr(error, "worker_failures", {}).values()]
    return next((e for e in found if isinstance(e, BadInput)), None)


class RefuseBadInput(UserCallback):
    """A Ray Train callback (it runs in the controller) that ends the run at a worker's `BadInput`. Ray's failure
    policy restarts the worker group after any worker error (`FailureConfig` cannot exempt one), and a restarted
    worker refuses the same input again; an error raised in a callback is the controller's own, which it does not
    retry."""

    def after_exception(self, run_context, worker_exceptions) -> None:
        bad = next((e for e in worker_exceptions.values() if isinstance(e, BadInput)), None)
        if bad is not None:
            controller_log = logging.getLogger(RAY_CONTROLLER_LOGGER)
            if _not_bad_input not in controller_log.filters:
                controller_log.addFilter(_not_bad_input)
            raise bad
