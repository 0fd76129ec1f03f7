"""The longest names the CRDs' rules accept are ones the operator can derive other names from (no object is accepted
and then dropped for a name): a Cell's name as a label value (63 characters) and in cell-<name> and
certify-<name>-<key>; a Session's in the worker session id <namespace>.<name> (the worker's pattern: 128). The
apiserver's side of the rules is tests/e2e/test_validation.py."""

from __future__ import annotations

import re

import pytest

import modeld_api as api
from modeld_cell.schemas import SESSION_ID_PATTERN
from modeld_operator import certification, placement
from modeld_operator.handlers.session import worker_session_id

pytestmark = pytest.mark.unit
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def test_the_longest_cell_name_derives_valid_names():
    cell = "c" * api.CELL_NAME_MAX
    assert DNS_LABEL.match(cell) and DNS_LABEL.match(placement.deployment_name(cell))
    assert DNS_LABEL.match(certification.job_name(cell, "0123456789abcdef" * 4))
    assert DNS_LABEL.match(certification.job_name("c" * 43 + "-x", "ab" * 32))   # a cut at a '-' still ends well


def test_the_longest_session_name_in_the_longest_namespace_is_a_worker_session_id():
    assert re.match(SESSION_ID_PATTERN, worker_session_id("n" * 63, "s" * api.SESSION_NAME_MAX))
    assert not re.match(SESSION_ID_PATTERN, worker_session_id("n" * 63, "s" * (api.SESSION_NAME_MAX + 1)))
