"""Checks that span sections of a validated config (a model's keys against its backend and
binary, memory budgets against the groups, the admin API against the listen address), and of
the files a resolved config names (`corral check`)."""

from corral.supervisor.config.checks.backends import check_backends
from corral.supervisor.config.checks.budgets import check_budgets
from corral.supervisor.config.checks.exposure import admin_exposure_problem, admin_is_exposed
from corral.supervisor.config.checks.files import missing_files

__all__ = ["admin_exposure_problem", "admin_is_exposed", "check_backends", "check_budgets",
           "missing_files"]
