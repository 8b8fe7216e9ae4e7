"""Checks that span sections of a validated config (a model's keys against its backend and
binary, memory budgets against the groups, the admin API against the listen address)."""

from corral.supervisor.config.checks.backends import check_backends
from corral.supervisor.config.checks.budgets import check_budgets
from corral.supervisor.config.checks.exposure import admin_exposure_problem, admin_is_exposed

__all__ = ["admin_exposure_problem", "admin_is_exposed", "check_backends", "check_budgets"]
