"""Offline analysis of run directories: the first divergence between two runs, trace certification."""

from samestep.analysis.certify import certify_trace
from samestep.analysis.diff import DiffError, Divergence, diff_runs

__all__ = ["DiffError", "Divergence", "certify_trace", "diff_runs"]
