"""kopf's settings as the operator sets them at startup (modeld_operator.__main__.tune)."""

from __future__ import annotations

import kopf
import pytest

import modeld_api as api
from modeld_operator.__main__ import tune
from modeld_operator.settings import SETTINGS

pytestmark = pytest.mark.unit


def test_a_deleted_object_waits_at_most_a_second_for_its_timers_to_stop():
    """A finalizer goes once the object's timers stopped; one caught mid-call is polled again after
    cancellation_polling (kopf's default: 60 s, so a Cell deleted while its status refresh ran took a minute more)."""
    settings = kopf.OperatorSettings()
    assert settings.background.cancellation_polling == 60       # the default this guards against
    tune(settings)
    assert settings.background.cancellation_polling <= 1.0


def test_watches_are_bounded_and_state_is_kept_under_the_groups_names():
    settings = kopf.OperatorSettings()
    tune(settings)
    assert settings.watching.server_timeout == SETTINGS.watch_server_timeout
    assert settings.watching.client_timeout == SETTINGS.watch_client_timeout
    assert settings.persistence.finalizer == api.FINALIZER


def test_the_stored_essence_is_the_spec_not_the_labels_a_bind_sets():
    """Update handlers filter on spec; a label the operator writes must not make kopf store the essence again."""
    settings = kopf.OperatorSettings()
    tune(settings)
    body = kopf.Body({"apiVersion": "modeld.contenox.io/v1alpha1", "kind": "Session",
                      "metadata": {"name": "s", "labels": {api.LABEL_CELL: "c"}, "annotations": {"a": "b"}},
                      "spec": {"modelFamily": "smollm2"}})
    essence = settings.persistence.diffbase_storage.build(body=body)
    assert essence["spec"] == {"modelFamily": "smollm2"}
    assert "labels" not in (essence.get("metadata") or {}) and "annotations" not in (essence.get("metadata") or {})
