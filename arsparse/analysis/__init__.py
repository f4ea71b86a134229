"""Attention characterization: measure and show where AR image models attend.

* :mod:`~arsparse.analysis.capture`: :class:`AttentionCapture`, hooks that record the attention of
  teacher-forced passes and of cached decoding, and always remove themselves;
* :mod:`~arsparse.analysis.metrics`: :class:`AttentionStats`, the statistics accumulated on the fly
  (prompt / sinks / local / band / rest mass, (k, delta) band map, offset profile, coverage,
  policy recall, oracle top-k, head classes);
* :mod:`~arsparse.analysis.report`: :func:`analyze` (the whole measurement on a model) and
  :func:`write_report` (``report.md``, ``stats.json`` and the figures of :mod:`~arsparse.analysis.plots`);
* :mod:`~arsparse.analysis.cli`: ``arsparse analyze``.
"""
from .capture import AttentionCapture, attention_weights, capture_decode, capture_teacher_forced
from .metrics import CATEGORIES, AttentionStats, MetricConfig, ReadSet, asymmetry, summarize, summarize_attention
from .report import Analysis, analyze, build_read_sets, write_report

__all__ = ["CATEGORIES", "Analysis", "AttentionCapture", "AttentionStats", "MetricConfig", "ReadSet", "analyze",
           "asymmetry", "attention_weights", "build_read_sets", "capture_decode", "capture_teacher_forced",
           "summarize", "summarize_attention", "write_report"]
