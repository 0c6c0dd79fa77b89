"""The deployment's worker environment: the documented set-up (docs/deployments.md) is the one the tests run,
and a worker started without RETRAIN_REPOSITORY / RETRAIN_HOME fails the run with a message naming them (a
real Prefect server, `prefect deploy --all` of prefect.yaml, a real `process` worker)."""

from __future__ import annotations

import asyncio
import re
import shlex
import time
from pathlib import Path

import pytest
from prefect_stack import PORT, SETUP, WORKER_VARIABLES, PrefectStack
from project_copy import make_project

from flows import workspace

ROOT = Path(__file__).resolve().parents[1]


def _documented_setup() -> tuple[list[tuple[str, ...]], list[str]]:
    """The `prefect ...` commands of the deployment block of docs/deployments.md up to the worker, and its
    exports (the README links that page)."""
    text = (ROOT / "docs" / "deployments.md").read_text()
    assert "(docs/deployments.md)" in (ROOT / "README.md").read_text()
    section = text[text.index("## Deployments: nightly, on demand, champion"):]
    block = section[section.index("```bash\n") + 8:]
    block = block[:block.index("```")]
    commands, exports = [], []
    for line in block.splitlines():
        line = line.split("  #")[0].strip().removesuffix("&").strip()
        if line.startswith("export "):
            exports += [word.split("=")[0] for word in shlex.split(line)[1:]]
        elif line.startswith("prefect ") and " deployment run " not in f" {line} ":
            words = shlex.split(line)[1:]
            commands.append(tuple(PORT if w == "4200" else w for w in words))
    return commands, exports


def test_the_documented_worker_setup_is_the_one_the_tests_run() -> None:
    commands, exports = _documented_setup()
    assert commands == SETUP
    assert exports == ["PREFECT_API_URL", *WORKER_VARIABLES]
    assert set(WORKER_VARIABLES) == set(workspace.WORKER_VARIABLES)


def test_a_missing_variable_is_named_with_its_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFECT__FLOW_RUN_ID", raising=False)  # outside a run: nothing to set Failed
    monkeypatch.setenv("RETRAIN_REPOSITORY", "/srv/fusion-retrain")
    monkeypatch.setenv("RETRAIN_HOME", "  ")  # blank counts as unset: `mkdir ''` is what it would do
    with pytest.raises(workspace.WorkerEnvironmentError) as err:
        asyncio.run(workspace.require_worker_environment())
    message = str(err.value)
    assert "lacks RETRAIN_HOME," in message and "RETRAIN_REPOSITORY" not in message
    assert 'export RETRAIN_HOME="$HOME/retrain"' in message and "restart the worker" in message
    monkeypatch.setenv("RETRAIN_HOME", "/var/lib/retrain")
    assert asyncio.run(workspace.require_worker_environment()) == {
        "retrain_repository": "/srv/fusion-retrain", "retrain_home": "/var/lib/retrain"}


@pytest.mark.slow
def test_a_worker_without_the_variables_fails_the_run_naming_them(tmp_path: Path) -> None:
    """Before: `mkdir: cannot create directory ''` in the worker's output, the run Crashed with only an exit
    code. Now: the run is Failed, its state message and its log name both variables and the exports; the
    worker restarted with them set runs the next one."""
    project = make_project(tmp_path / "project")
    (tmp_path / "prefect_home").mkdir()
    stack = PrefectStack(project, tmp_path / "prefect_home", tmp_path / "retrain_home")
    for name in WORKER_VARIABLES:
        stack.env.pop(name, None)
    try:
        stack.deploy()
        flow_run_id = stack.submit("champion/champion")
        state = stack.wait(flow_run_id, timeout_s=300)["state"]
        # the worker reports the ended process afterwards: the run must stay Failed, not turn Crashed
        deadline = time.monotonic() + 60
        while "Process exited" not in stack.log("worker") and time.monotonic() < deadline:
            time.sleep(0.5)
        final = stack.get(f"/flow_runs/{flow_run_id}")["state"]
        made_before = (tmp_path / "retrain_home").exists()
        logs = [entry["message"] for entry in
                stack.post("/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}})]
        # the fix the message gives: restart the worker with the variables set; the next run completes
        stack.stop_one("worker")
        stack.env |= {"RETRAIN_REPOSITORY": str(project), "RETRAIN_HOME": str(tmp_path / "retrain_home")}
        stack.start("worker", *SETUP[-1])
        fixed = stack.wait(stack.submit("champion/champion"), timeout_s=300)["state"]
    finally:
        stack.stop()
    assert state["type"] == final["type"] == "FAILED", (final, stack.log("worker"))
    message = final["message"]
    assert re.search(r"lacks RETRAIN_REPOSITORY and RETRAIN_HOME", message), message
    assert 'export RETRAIN_REPOSITORY="$PWD"' in message and 'export RETRAIN_HOME="$HOME/retrain"' in message
    assert any(message in line for line in logs), logs
    assert not made_before  # no later pull step ran: nothing cloned, nothing made
    assert fixed["type"] == "COMPLETED", (fixed, stack.log("worker"))
    assert (tmp_path / "retrain_home" / "workspace" / "prefect.yaml").is_file()
