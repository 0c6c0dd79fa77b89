"""The first pull step of every deployment (prefect.yaml): the worker's environment must say what a run
clones and where its workspace lives, or the run fails with a message naming the variable to set.

Without this step, an unset variable reaches the next pull step as an empty string (`mkdir ''`) and the
run ends Crashed with "Process exited with status code: 1", the cause only in the worker's own output.
Here the run ends Failed, its state message and its log saying which variable is missing and how to
set it. The step runs in the worker's Python (before anything is cloned), so it imports only Prefect.
"""

from __future__ import annotations

import os
from uuid import UUID

# name -> what it is and how to set it (README, "Deployments"; the same commands the tests run)
WORKER_VARIABLES: dict[str, str] = {
    "RETRAIN_REPOSITORY": "the repository each run clones, a local path or a git URL (from the project "
                          "root: `export RETRAIN_REPOSITORY=\"$PWD\"`)",
    "RETRAIN_HOME": "the folder the run workspace lives in (`export RETRAIN_HOME=\"$HOME/retrain\"`)",
}


class WorkerEnvironmentError(RuntimeError):
    """The worker was started without a variable the deployments' pull steps need."""


def missing_variables(environ: dict[str, str] | None = None) -> list[str]:
    """The variables of WORKER_VARIABLES that are unset or empty, in their order."""
    env = os.environ if environ is None else environ
    return [name for name in WORKER_VARIABLES if not env.get(name, "").strip()]


def missing_message(missing: list[str]) -> str:
    what = "; ".join(f"{name}: {WORKER_VARIABLES[name]}" for name in missing)
    return (f"the worker's environment lacks {' and '.join(missing)}, so this run cannot clone the project "
            f"into its workspace. Set {'them' if len(missing) > 1 else 'it'} where the worker starts ({what}), "
            "then restart the worker (`prefect worker start --pool retrain-pool`) and run the deployment again.")


async def require_worker_environment() -> dict[str, str]:
    """Pull step: return the variables' values, or fail the flow run with a message naming the missing ones.

    The run is set Failed with that message through the API first (the exception alone would end it
    Crashed with only an exit code), then the step raises so no later pull step runs.
    """
    missing = missing_variables()
    if not missing:
        return {name.lower(): os.environ[name] for name in WORKER_VARIABLES}
    message = missing_message(missing)
    flow_run_id = os.environ.get("PREFECT__FLOW_RUN_ID")
    if flow_run_id:
        from prefect.client.orchestration import get_client
        from prefect.logging.loggers import flow_run_logger
        from prefect.states import Failed

        async with get_client() as client:
            flow_run = await client.read_flow_run(UUID(flow_run_id))
            flow_run_logger(flow_run).error(message)
            await client.set_flow_run_state(flow_run.id, Failed(message=message))
    raise WorkerEnvironmentError(message)
