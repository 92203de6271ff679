"""The metrics table (``sidecar.telemetry.metrics._SPECS``) and the typed attributes of
:class:`Metrics` say the same: one annotation per row, of the row's kind, in its order."""

from __future__ import annotations

import typing

from sidecar.telemetry import metrics
from sidecar.telemetry.metrics import _SPECS, Metrics


def test_each_row_has_its_typed_attribute_and_each_metric_attribute_a_row() -> None:
    hints = typing.get_type_hints(Metrics, vars(metrics))
    declared = [s.attr for s in _SPECS]
    assert len(set(declared)) == len(declared), "an attribute named by two rows"
    assert len({s.name for s in _SPECS}) == len(_SPECS), "a metric name in two rows"
    for spec in _SPECS:
        assert hints.get(spec.attr) is spec.kind, (spec.attr, hints.get(spec.attr), spec.kind)
    kinds = {s.kind for s in _SPECS}
    annotated = [name for name, hint in hints.items() if hint in kinds]
    assert annotated == declared  # no attribute left without a row, and the same order


def test_a_built_metrics_holds_each_rows_metric() -> None:
    m = Metrics()
    for spec in _SPECS:
        assert isinstance(getattr(m, spec.attr), spec.kind), spec.attr
