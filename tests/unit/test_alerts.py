"""The alerting rules (deploy/prometheus/alerts.yml) load, and each one fires and stays
quiet as its unit test in alerts_test.yml says, under Prometheus' own ``promtool``.

``promtool`` comes with Debian's ``prometheus`` package, which scripts/test.sh installs
before the suite runs in CI. Without it these tests FAIL, saying how to install it, so that
they cannot rot as skips; ``ZMQ_ROLLOUT_NO_PROMETHEUS=1`` skips them deliberately (the rule
of tests/integration/test_prometheus_scrape.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = PROMETHEUS / "alerts.yml"
RULE_TESTS = PROMETHEUS / "alerts_test.yml"
SKIP_ENV = "ZMQ_ROLLOUT_NO_PROMETHEUS"


def promtool_binary() -> str:
    """``promtool``; fails the test (or skips it, if ``ZMQ_ROLLOUT_NO_PROMETHEUS=1``) without one."""
    path = shutil.which("promtool")
    if path is None and os.access("/usr/bin/promtool", os.X_OK):
        path = "/usr/bin/promtool"  # not on PATH (a minimal PATH in CI)
    if path is not None:
        return path
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: no promtool on this machine")
    pytest.fail(
        "promtool is missing (no `promtool` on PATH, no /usr/bin/promtool). Install it with "
        "`apt-get install -y prometheus` (scripts/test.sh does), or set ZMQ_ROLLOUT_NO_PROMETHEUS=1 to skip "
        "these tests deliberately."
    )


def promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess[str]:
    binary = promtool_binary()
    return subprocess.run([binary, *args], check=False, capture_output=True, text=True, timeout=60, cwd=cwd)


def rules() -> list[dict[str, object]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_the_rules_load() -> None:
    done = promtool("check", "rules", RULES.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def test_every_rule_passes_its_unit_tests() -> None:
    done = promtool("test", "rules", RULE_TESTS.name)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_rule_has_a_case_that_fires_and_one_that_does_not() -> None:
    cases = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    evaluations = [e for case in cases for e in case["alert_rule_test"]]
    for rule in rules():
        name = rule["alert"]
        assert any(e["alertname"] == name and e["exp_alerts"] for e in evaluations), f"{name} never fires"
        assert any(e["alertname"] == name and not e["exp_alerts"] for e in evaluations), f"{name} never stays quiet"


def test_prometheus_yml_loads_the_rules() -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert RULES.name in config["rule_files"]
    done = promtool("check", "config", "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"SUCCESS: \d+ rules found", done.stdout)


def test_a_broken_rule_fails_its_unit_test(tmp_path: Path) -> None:
    """The unit tests can fail: with the flapping bound raised, the flapping case does."""
    rule = "changes(zmq_rollout_worker_joins_total[15m]) >= 3"
    assert rule in RULES.read_text()
    (tmp_path / RULES.name).write_text(RULES.read_text().replace(rule, rule.replace("3", "5")))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    done = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert done.returncode != 0
    assert "ZmqRolloutWorkerFlapping" in done.stdout + done.stderr


def test_a_missing_promtool_fails_unless_skipped_deliberately(monkeypatch: pytest.MonkeyPatch) -> None:
    """No promtool: a failure naming the fix; with ZMQ_ROLLOUT_NO_PROMETHEUS=1, a skip."""
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    monkeypatch.setattr(os, "access", lambda _path, _mode: False)
    monkeypatch.delenv(SKIP_ENV, raising=False)
    with pytest.raises(pytest.fail.Exception, match="apt-get install -y prometheus"):
        promtool_binary()
    monkeypatch.setenv(SKIP_ENV, "1")
    with pytest.raises(pytest.skip.Exception, match=SKIP_ENV):
        promtool_binary()
