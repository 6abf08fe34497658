"""Evaluation: benchmark readers, answer extraction and metrics, batched evaluation, toy reproductions, quickstart."""
