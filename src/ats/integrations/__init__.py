"""Bridges to other tools: lm-evaluation-harness (the `ats` model, calibration reports of its sample files).

Nothing here is imported by `import ats`; `ats.integrations.lm_eval_model` imports lm-eval (the `lm-eval` extra) and
registers the `ats` model with it on import.
"""
