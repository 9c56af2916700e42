"""`skylift view RUN_DIR`: a run's recorded rollouts and step times as an HTML report."""

from skylift.viewer.report import NoRecordsError, build_report

__all__ = ["NoRecordsError", "build_report"]
